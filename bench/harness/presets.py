"""Shape presets: one MoE layer as one rank computes it.

A preset fixes the layer (H, I, E, K), the expert-parallel degree EP (the rank holds NR = E/EP
experts, ``[0, NR)`` in the benchmark) and the tokens T that reach this rank's experts. With EP > 1
T is the all-gathered batch, ``EP * tokens_per_rank``, as in FastSparseMoE's stage 1.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token, NR local experts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fastmoe_xpu.shape_sets import SHAPE_SETS as _SHAPE_DATA


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens_per_rank: int
    ep: int = 1
    description: str = ""

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def tokens(self) -> int:
        """T: tokens this rank's experts see (after the all-gather when EP > 1)."""
        return self.tokens_per_rank * self.ep

    @property
    def expected_rows(self) -> float:
        """Routed rows on this rank under uniform routing: ``T * K * NR / E``."""
        return self.tokens * self.top_k * self.local_experts / self.experts

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(local_experts=self.local_experts, tokens=self.tokens)
        return d


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("mula-7b-a1b", 2048, 1024, 64, 8, 2048, 1,
               "Mula-7B-A1B layer, one rank, 2048 tokens (256 rows per expert)"),
        Preset("mula-7b-a1b-small", 2048, 1024, 64, 8, 256, 1,
               "Mula-7B-A1B layer, 256 tokens (32 rows per expert: per-expert overheads dominate)"),
        Preset("mula-20b-a2b", 2048, 1024, 96, 8, 2048, 12,
               "Mula-20B-A2B local slice: 8 of 96 experts (EP=12), all-gathered 12 x 2048 tokens"),
        Preset("mula-220b-a10b", 3072, 1536, 240, 8, 2048, 12,
               "Mula-220B-A10B local slice: 20 of 240 experts (EP=12), all-gathered 12 x 2048 tokens"),
        Preset("olmoe-decode-1", 2048, 1024, 64, 8, 1, 1, "OLMoE-1B-7B layer at decode: 1 token (8 rows)"),
        Preset("olmoe-decode-8", 2048, 1024, 64, 8, 8, 1, "OLMoE-1B-7B layer at decode: 8 tokens (64 rows)"),
        Preset("olmoe-decode-64", 2048, 1024, 64, 8, 64, 1, "OLMoE-1B-7B layer: 64 tokens (512 rows, 8 per expert)"),
        Preset("olmoe-decode-256", 2048, 1024, 64, 8, 256, 1,
               "OLMoE-1B-7B layer: 256 tokens (2048 rows, 32 per expert)"),
        *(Preset(f"qwen3-decode-{t}", 2048, 768, 128, 8, t, 1,
                 f"Qwen3-30B-A3B layer at decode: {t} token{'s' if t > 1 else ''} ({8 * t} rows)")
          for t in (1, 8, 64, 256)),
        Preset("int8-layer", 1536, 768, 32, 6, 1024, 1,
               "a mid-size layer, 1024 tokens (192 rows per expert): the shape the CPU int8 goal is stated on"),
        Preset("mid-layer", 1536, 768, 48, 6, 1024, 1,
               "a mid-size layer, 1024 tokens (128 rows per expert): the small-layer goal's GEMM-only bound case"),
        Preset("tiny", 64, 32, 8, 2, 48, 1, "tiny shapes for tests"),
        Preset("tiny-ep", 64, 32, 8, 2, 24, 2, "tiny local slice (EP=2) for tests"),
    )
}

#: What ``fastmoe-bench`` runs without ``--preset``: the two presets the CPU goals are stated on.
DEFAULT_PRESETS = ("mula-7b-a1b-small", "mula-7b-a1b")
#: The small-shape sweep (``--preset sweep``): a first try, decode and the Mula layer.
SWEEP_PRESETS = ("tiny", "olmoe-decode-1", "olmoe-decode-8", "olmoe-decode-64", "mula-7b-a1b-small", "mula-7b-a1b")
#: Decode on a GPU (``--preset decode``, with ``--mode infer --cuda-graph``): OLMoE-1B-7B and
#: Qwen3-30B-A3B layers at T = 1, 8, 64 and 256 tokens.
DECODE_PRESETS = tuple(f"{m}-decode-{t}" for m in ("olmoe", "qwen3") for t in (1, 8, 64, 256))


def resolve_presets(names: list[str] | None) -> list[Preset]:
    """Names to presets; ``all`` expands to every non-test preset."""
    if not names:
        names = list(DEFAULT_PRESETS)
    out: list[Preset] = []
    for n in names:
        if n == "sweep":
            out.extend(PRESETS[m] for m in SWEEP_PRESETS)
        elif n == "decode":
            out.extend(PRESETS[m] for m in DECODE_PRESETS)
        elif n == "all":
            out.extend(p for p in PRESETS.values() if p.name.startswith("mula"))
        elif n in PRESETS:
            out.append(PRESETS[n])
        else:
            raise ValueError(f"unknown preset {n!r}; known: {sorted(PRESETS)}, 'all', 'sweep' or 'decode'")
    return out


#: The layers the published MoE kernels compare on (one MoE layer each; ``--shapes practitioners``): the
#: package's :data:`fastmoe_xpu.shape_sets.SHAPE_SETS` as presets.
SHAPE_SETS: dict[str, tuple[Preset, ...]] = {name: tuple(Preset(*entry) for entry in entries)
                                             for name, entries in _SHAPE_DATA.items()}


def _scaled(width: int, scale: int) -> int:
    """``width / scale`` rounded down to a multiple of 8 (at least 8), so that rows stay 16-byte
    aligned as the real widths are (grouped GEMMs and TMA descriptors require it)."""
    return width if scale == 1 else max(8, width // scale // 8 * 8)


def shape_set(name: str, *, scale: int = 1, tokens: int | None = None) -> list[Preset]:
    """The presets of shape set ``name`` with H and I divided by ``scale`` (:func:`_scaled`; a machine too small or
    slow for the real layer; the name says so) and T = ``tokens`` (all-gathered T under EP)."""
    if name not in SHAPE_SETS:
        raise ValueError(f"unknown shape set {name!r}; known: {sorted(SHAPE_SETS)}")
    if scale < 1 or (tokens is not None and tokens < 1):
        raise ValueError(f"scale and tokens must be >= 1, got scale={scale}, tokens={tokens}")
    out = []
    for p in SHAPE_SETS[name]:
        per_rank = p.tokens_per_rank if tokens is None else max(1, tokens // p.ep)
        suffix = f"/{scale}" if scale > 1 else ""
        out.append(replace(p, name=p.name + suffix, hidden=_scaled(p.hidden, scale),
                           intermediate=_scaled(p.intermediate, scale), tokens_per_rank=per_rank))
    return out

"""Data mixtures: several preprocessed data sets blended by weight into one instance stream.

``--data web=data/web:0.7,code=data/code:0.3`` names each source ``NAME=PATH:WEIGHT``; a plain
path (no ``=``) is one data set, read exactly as before.

The stream is the loader's (:mod:`trainer.data.loader`): global index g = 0, 1, 2, ... The
mixture decides which source g comes from with a fixed interleave pattern of ``PERIOD`` slots:
source s gets ``c_s`` slots (its weight's share, rounded by largest remainder; a source of weight
0 gets none and serves only validation), and ``numpy.random.default_rng([seed, 0x6d6978])``
shuffles the slots once. Slot ``g % PERIOD`` names the source; its index in that source's own
stream is ``(g // PERIOD) * c_s`` plus how many earlier slots of the period are that source's. So
the source of every instance of a global batch is a function of the seed and the step, each source
reads its own shuffled order (and reshuffles per epoch) without skipping or repeating, and the
loader's position (``next_instance``) alone resumes the mixture exactly, on any DP layout.
"""
from __future__ import annotations

import hashlib
import math
import os
from typing import Any, NamedTuple

import numpy as np

from ..config.errors import ConfigError
from .loader import ShardedDataset, load_manifest

PERIOD = 10000


class Source(NamedTuple):
    name: str
    path: str
    weight: float


def is_mixture(spec: str | None) -> bool:
    return spec is not None and "=" in spec


def parse_mixture(spec: str) -> list[Source]:
    """``NAME=PATH:WEIGHT,...`` -> sources; ConfigError naming the entry and the fix when malformed,
    a weight is negative or not a number, the total is 0 or a name repeats."""
    form = "--data NAME=PATH:WEIGHT,NAME=PATH:WEIGHT (e.g. --data web=data/web:0.7,code=data/code:0.3)"
    out: list[Source] = []
    entries = spec.split(",")
    for entry in entries:
        name, eq, rest = entry.strip().partition("=")
        path, colon, w = rest.rpartition(":")
        if not eq or not colon or not name.strip() or not path.strip():
            commas = (" (commas separate the entries, so a path cannot hold one: link the data set under a name "
                      "without a comma)" if len(entries) > 1 else "")
            raise ConfigError(f"--data mixture entry {entry.strip()!r} is not NAME=PATH:WEIGHT{commas}; write {form}")
        try:
            weight = float(w)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"--data source {name.strip()!r} has weight {w!r}; give a number >= 0, as in {form}")
        if any(s.name == name.strip() for s in out):
            raise ConfigError(f"--data names source {name.strip()!r} twice; give each source its own name")
        out.append(Source(name.strip(), path.strip(), weight))
    if sum(s.weight for s in out) <= 0:
        raise ConfigError(f"--data mixture weights add up to 0; give at least one source a weight > 0, as in {form}")
    return out


def open_sources(spec: str) -> tuple[list[Source], list[dict[str, Any]]]:
    """The parsed sources and their manifests; ConfigError for a missing set, or sets of different
    context or tokenizer."""
    sources = parse_mixture(spec)
    manifests = []
    for s in sources:
        try:
            manifests.append(load_manifest(s.path))
        except ValueError as e:
            raise ConfigError(f"--data source {s.name!r}: {e}") from None
    first = manifests[0]
    for s, m in zip(sources[1:], manifests[1:]):
        t0, t1 = dict(first["tokenizer"] or {}), dict(m["tokenizer"] or {})
        if t0 != t1 and {**t0, "eos_id": None} == {**t1, "eos_id": None} and None in (t0.get("eos_id"), t1.get("eos_id")):
            # the same tokenizer, one manifest made before data sets recorded their end-of-document id
            lacking = s if t1.get("eos_id") is None else sources[0]
            raise ConfigError(f"--data source {lacking.name!r} ({lacking.path}) records no end-of-document id (its "
                              f"manifest is older), the others do, with the same tokenizer: make it again with "
                              f"fastmoe-preprocess, which records it")
        for key, what in (("context", "context"), ("tokenizer", "tokenizer")):
            if m[key] != first[key]:
                raise ConfigError(
                    f"--data sources {sources[0].name!r} and {s.name!r} have different {what} ({first[key]} vs "
                    f"{m[key]}); preprocess them with the same --context and --tokenizer")
    return sources, manifests


def data_context(spec: str) -> int:
    """The context a ``--data`` value (one data set or a mixture) was cut to."""
    if is_mixture(spec):
        return int(open_sources(spec)[1][0]["context"])
    return int(load_manifest(spec)["context"])


def slot_counts(weights: list[float], period: int = PERIOD) -> list[int]:
    """Slots per source in one period: the weights' shares, rounded by largest remainder."""
    total = sum(weights)
    exact = [w / total * period for w in weights]
    counts = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: period - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureDataset:
    """The loader's data set for a mixture: ``instances(g)`` maps global indices to the sources'
    own streams (module doc). ``manifest`` carries what the trainer reads of one (context,
    tokenizer, path) and ``sources``/``datasets``/``manifests`` the parts."""

    def __init__(self, spec: str, verify: bool = True, seed: int = 0) -> None:
        self.sources, self.manifests = open_sources(spec)
        self.datasets = [ShardedDataset(m, verify=verify) for m in self.manifests]
        first = self.datasets[0]
        self.context, self.tokenizer, self.vocab_size = first.context, first.tokenizer, first.vocab_size
        self.eos_id = first.eos_id  # the parts share one tokenizer (open_sources)
        self.num_instances = sum(d.num_instances for d in self.datasets)
        self.counts = slot_counts([s.weight for s in self.sources])
        pattern = np.repeat(np.arange(len(self.sources)), self.counts)
        self.pattern = np.random.default_rng([seed, 0x6D6978]).permutation(pattern)
        self.rank_in_period = np.zeros(PERIOD, dtype=np.int64)
        for k in range(len(self.sources)):
            sel = self.pattern == k
            self.rank_in_period[sel] = np.arange(int(sel.sum()))
        h = hashlib.sha256(f"mixture seed {seed}".encode())
        for s, d in zip(self.sources, self.datasets):
            h.update(f"|{s.name}={d.fingerprint}:{s.weight!r}".encode())
        self.fingerprint = h.hexdigest()
        self.manifest = {"context": self.context, "tokenizer": self.tokenizer, "_path": spec}

    def source_of(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, index in that source's stream) of global indices ``g``."""
        g = np.asarray(g, dtype=np.int64)
        period, slot = np.divmod(g, PERIOD)
        src = self.pattern[slot]
        return src, period * np.asarray(self.counts, dtype=np.int64)[src] + self.rank_in_period[slot]

    def instances(self, g: np.ndarray) -> np.ndarray:
        src, local = self.source_of(g)
        out = np.empty((src.size, self.context + 1), dtype=self.datasets[0].dtype)
        for k in np.unique(src):
            sel = src == k
            out[sel] = self.datasets[int(k)].instances(local[sel])
        return out

    def describe(self) -> str:
        """One line for the run's header: each source's weight, share of slots and instances."""
        parts = [f"{s.name} {s.weight:g} ({c / PERIOD:.1%} of instances; {d.num_instances} stored, "
                 f"{os.path.relpath(d.dir) if not os.path.isabs(s.path) else d.dir})"
                 for s, c, d in zip(self.sources, self.counts, self.datasets)]
        return "mixture of " + ", ".join(parts)


def open_dataset(spec: str, verify: bool = True, seed: int = 0) -> ShardedDataset | MixtureDataset:
    """``--data``'s data set: one preprocessed set, or a mixture of several."""
    return MixtureDataset(spec, verify=verify, seed=seed) if is_mixture(spec) else ShardedDataset(spec, verify=verify)

"""Reading preprocessed shards: global batches, data-parallel slices, micro-batches, resume.

Names: G = global batch (instances per optimizer step), D = data-parallel size, d = this rank,
B = micro batch, M = G / (D * B) micro-batches per step, C = context, N = stored instances.

The loader walks an endless stream of instances with global index g = 0, 1, 2, ...
- g maps to epoch e = g // N and position r = g % N. Epoch 0 reads stored instance r (the order
  preprocessing already shuffled); epoch e >= 1 reads stored instance
  `numpy.random.default_rng([seed, e]).permutation(N)[r]`, a fresh deterministic reshuffle per
  epoch. A global batch may straddle two epochs; no instance is skipped.
- The step whose first instance is g covers [g, g + G); rank d reads [g + d*G/D, g + (d+1)*G/D)
  and cuts it into M micro-batches of B in order.
- The position is the next unseen global index; `state_dict()` stores it, so a resumed run
  continues exactly where the last finished step left off, whatever D and B it resumes with.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from .build import FORMAT_VERSION, MANIFEST_NAME, sha256_file


class MicroBatch(NamedTuple):
    """input_ids [B, C] and labels [B, C] (int64), labels[:, t] = the token after input_ids[:, t];
    already shifted, so an HF causal LM must not shift again (pass them as `shift_labels`)."""

    input_ids: torch.Tensor
    labels: torch.Tensor


def load_manifest(path: str) -> dict[str, Any]:
    """Accepts the manifest file or its directory; raises ValueError with one line when it cannot."""
    given = path
    if os.path.isdir(path):
        path = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(path):
        how = (_preprocess_hint(given, "DIR") if os.path.isdir(given)
               else _preprocess_hint("TEXT...", given if not given.endswith(MANIFEST_NAME) else os.path.dirname(given)))
        raise ValueError(f"data manifest {path!r} does not exist; run fastmoe-preprocess first: {how}")
    try:
        with open(path) as f:
            m = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not a data set's {MANIFEST_NAME} (it is binary); make a data set of it first: "
                         f"{_preprocess_hint(path, 'DIR')}") \
            from None
    except ValueError as e:
        if os.path.basename(path) != MANIFEST_NAME:  # raw text (or JSONL) given where a data set belongs
            raise ValueError(f"{path!r} is not a data set's {MANIFEST_NAME} but an input file; make a data set "
                             f"of it first: {_preprocess_hint(path, 'DIR')}") from None
        raise ValueError(f"data manifest {path!r} is unreadable: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise ValueError(f"data manifest {path!r} is unreadable: {' '.join(str(e).split())}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_VERSION:
        if os.path.basename(path) != MANIFEST_NAME:
            raise ValueError(f"{path!r} is not a data set's {MANIFEST_NAME}; if it is training text, make a data set "
                             f"of it first: {_preprocess_hint(path, 'DIR')}")
        raise ValueError(f"data manifest {path!r} is not a {FORMAT_VERSION} manifest")
    m["_path"] = os.path.abspath(path)
    return m


def manifest_eos_id(manifest: dict[str, Any]) -> int | None:
    """The end-of-document id a data set (or a mixture: its parts share one tokenizer) records, or None for a
    data set that does not record one."""
    eos = dict(manifest.get("tokenizer") or {}).get("eos_id")
    return None if eos is None or isinstance(eos, bool) else int(eos)


def _preprocess_hint(inputs: str, out: str) -> str:
    """The command that makes a data set of ``inputs`` in ``out`` for ``--data``."""
    return f"fastmoe-preprocess --input {inputs} --context C --out {out}, then --data {out}"


class ShardedDataset:
    """The N stored instances of one manifest, shards memory-mapped lazily on first access.
    With `verify` (the default) every shard's sha256 is checked here, once, before training."""

    def __init__(self, manifest: str | dict[str, Any], verify: bool = True) -> None:
        self.manifest = load_manifest(manifest) if isinstance(manifest, str) else manifest
        m = self.manifest
        self.dir = os.path.dirname(m["_path"])
        self.context = int(m["context"])
        self.num_instances = int(m["num_instances"])
        self.seed = int(m["seed"])
        self.dtype = np.dtype(m["dtype"])
        self.fingerprint = str(m["fingerprint"])
        self.tokenizer = dict(m["tokenizer"])
        self.vocab_size = int(self.tokenizer["vocab_size"])
        self.eos_id = manifest_eos_id(m)
        self._shards = m["shards"]
        self._first = np.array([s["first_instance"] for s in self._shards], dtype=np.int64)
        self._arrays: list[np.ndarray | None] = [None] * len(self._shards)
        self._epoch_perm: dict[int, np.ndarray] = {}
        for s in self._shards:
            path = self._path(s)
            if not os.path.isfile(path):
                raise ValueError(f"data shard {path} is missing (listed in {m['_path']})")
            if verify:
                got = sha256_file(path)
                if got != s["sha256"]:
                    raise ValueError(
                        f"data shard {path} is corrupt: sha256 {got[:16]}... differs from the manifest's {s['sha256'][:16]}..."
                    )

    def _path(self, shard: dict[str, Any]) -> str:
        return os.path.join(self.dir, os.path.basename(shard["file"]))

    def _array(self, k: int) -> np.ndarray:
        a = self._arrays[k]
        if a is None:
            s = self._shards[k]
            path = self._path(s)
            try:
                a = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise ValueError(f"data shard {path} does not load: {' '.join(str(e).split())}") from None
            want = (int(s["instances"]), self.context + 1)
            if a.shape != want or a.dtype != self.dtype:
                raise ValueError(f"data shard {path} is corrupt: {a.dtype}{list(a.shape)} instead of {self.dtype}{list(want)}")
            self._arrays[k] = a
        return a

    def stored(self, idx: np.ndarray) -> np.ndarray:
        """Stored instances `idx` (indices into the permuted order) as [len(idx), C + 1]."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_instances):
            raise IndexError(f"instance index out of range [0, {self.num_instances})")
        out = np.empty((idx.size, self.context + 1), dtype=self.dtype)
        shard = np.searchsorted(self._first, idx, side="right") - 1
        for k in np.unique(shard):
            sel = shard == k
            out[sel] = self._array(int(k))[idx[sel] - self._first[k]]
        return out

    def epoch_order(self, epoch: int) -> np.ndarray | None:
        """Stored index of each position in `epoch`; None means the stored order (epoch 0)."""
        if epoch == 0:
            return None
        if epoch not in self._epoch_perm:
            if len(self._epoch_perm) >= 2:  # a batch touches at most two epochs
                self._epoch_perm.pop(min(self._epoch_perm))
            self._epoch_perm[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_instances)
        return self._epoch_perm[epoch]

    def global_to_stored(self, g: np.ndarray) -> np.ndarray:
        """Map global stream indices to stored instance indices (epoch wrap-around)."""
        g = np.asarray(g, dtype=np.int64)
        epoch, pos = np.divmod(g, self.num_instances)
        out = pos.copy()
        for e in np.unique(epoch):
            order = self.epoch_order(int(e))
            if order is not None:
                sel = epoch == e
                out[sel] = order[pos[sel]]
        return out

    def instances(self, g: np.ndarray) -> np.ndarray:
        """Global stream indices -> [len(g), C + 1] tokens."""
        return self.stored(self.global_to_stored(g))


class ShardedLoader:
    """This DP rank's micro-batches of consecutive global batches, resumable.

    Iterating yields, per optimizer step, a list of M `MicroBatch`es; `state_dict()` /
    `load_state_dict()` save and restore the position."""

    def __init__(
        self,
        data: str | Any,
        global_batch: int,
        micro_batch: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        verify: bool = True,
    ) -> None:
        for name, v in (("global batch", global_batch), ("data-parallel size", dp_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by data-parallel size {dp_size}")
        per_rank = global_batch // dp_size
        micro_batch = per_rank if micro_batch is None else micro_batch
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            raise ValueError(f"micro batch must be a positive integer, got {micro_batch!r}")
        if per_rank % micro_batch:
            raise ValueError(
                f"per-rank batch {per_rank} (global batch {global_batch} / data-parallel size {dp_size}) "
                f"is not divisible by micro batch {micro_batch}"
            )
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank!r} is outside [0, {dp_size})")
        self.dataset = ShardedDataset(data, verify=verify) if isinstance(data, str) else data  # or a mixture
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro_batches_per_step = per_rank // micro_batch
        self.next_instance = 0

    @property
    def context(self) -> int:
        return self.dataset.context

    @property
    def step(self) -> int:
        """Steps taken so far at the current global batch size."""
        return self.next_instance // self.global_batch

    def rank_indices(self, first_instance: int) -> np.ndarray:
        """Global indices this rank reads in the step starting at `first_instance`."""
        per_rank = self.global_batch // self.dp_size
        start = first_instance + self.dp_rank * per_rank
        return np.arange(start, start + per_rank, dtype=np.int64)

    def batch_at(self, first_instance: int) -> list[MicroBatch]:
        """This rank's micro-batches of the step starting at global index `first_instance`,
        without moving the position."""
        tokens = torch.from_numpy(self.dataset.instances(self.rank_indices(first_instance)).astype(np.int64))
        out = []
        for a in range(0, tokens.shape[0], self.micro_batch):
            t = tokens[a : a + self.micro_batch]
            out.append(MicroBatch(t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        return out

    def next_batch(self) -> list[MicroBatch]:
        """The next step's micro-batches for this rank; advances the position by one global batch."""
        out = self.batch_at(self.next_instance)
        self.next_instance += self.global_batch
        return out

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_instance": self.next_instance,
            "step": self.step,
            "global_batch": self.global_batch,
            "epoch": self.next_instance // self.dataset.num_instances,
            "fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["next_instance"]`; refuses a state made on another data set."""
        if state.get("fingerprint") != self.dataset.fingerprint:
            raise ValueError(f"loader state was saved on a different data set: fingerprint "
                             f"{str(state.get('fingerprint'))[:12]}, this one ({self.dataset.manifest['_path']}) has "
                             f"{self.dataset.fingerprint[:12]}")
        nxt = state.get("next_instance")
        if isinstance(nxt, bool) or not isinstance(nxt, int) or nxt < 0:
            raise ValueError(f"loader state has an invalid next_instance {nxt!r}")
        self.next_instance = nxt

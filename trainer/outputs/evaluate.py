"""Held-out evaluation: the loss and perplexity of the data set's validation split.

The split (``valid.npy``, written by data preparation, see :mod:`trainer.data.build`) is read
whole on every rank. Validation instance ``i`` goes to data rank ``i % R`` (R = DP x EP data
ranks); every rank runs the same number of micro-batches of ``micro_batch`` rows, padded with rows
whose labels are all ignored, because expert-parallel exchanges need equal token counts on every
EP rank. Each instance's summed cross-entropy (fp32 logits, accumulated in fp64) lands in its own
slot of an ``[N]`` vector that one all-reduce fills (every slot has exactly one writer, the others
add exact zeros), and every rank then adds the slots in instance order. So the token count is
exact, and the loss is the same sum of the same per-instance numbers on every layout: it differs
between layouts only by the rounding of the per-instance forward passes themselves.

Under pipeline parallelism the stages run the micro-batches one after another with point-to-point
sends (no schedule, no backward); the last stage's ranks hold the numbers, and the all-reduce runs
over the whole world.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.build import VALID_NAME, sha256_file
from ..layout import all_reduce_sum, pp_group
from ..model.documents import document_kwargs
from ..model.loss import IGNORE_INDEX
from ..optim.fsdp import is_fsdp, reshard


def load_validation(manifest: dict[str, Any], verify: bool = True) -> np.ndarray | None:
    """The validation rows ``[N, C + 1]`` of a loaded manifest, or None when it keeps no split.
    ValueError naming the file when it is missing or fails its checksum."""
    meta = manifest.get("valid")
    if not meta:
        return None
    path = os.path.join(os.path.dirname(manifest["_path"]), meta.get("file", VALID_NAME))
    if not os.path.isfile(path):
        raise ValueError(f"validation split {path} named by {manifest['_path']} is missing")
    if verify and sha256_file(path) != meta.get("sha256"):
        raise ValueError(f"validation split {path} fails its sha256 check (corrupt or replaced)")
    rows = np.load(path, mmap_mode="r")
    if rows.ndim != 2 or rows.shape[0] != int(meta["instances"]) or rows.shape[1] != int(manifest["context"]) + 1:
        raise ValueError(f"validation split {path} has shape {rows.shape}, the manifest says "
                         f"[{meta['instances']}, {int(manifest['context']) + 1}]")
    return np.asarray(rows, dtype=np.int64)


def load_data_validation(dataset: Any, verify: bool = True) -> np.ndarray | dict[str, tuple[np.ndarray, float]] | None:
    """The validation rows of ``--data``'s data set: its split's rows, or for a mixture
    ``{source name: (rows, weight)}`` of the sources that keep a split; None when none does."""
    if not hasattr(dataset, "sources"):
        return load_validation(dataset.manifest, verify=verify)
    out = {}
    for s, m in zip(dataset.sources, dataset.manifests):
        rows = load_validation(m, verify=verify)
        if rows is not None:
            out[s.name] = (rows, s.weight)
    return out or None


def rank_batches(rows: np.ndarray, data_rank: int, data_world: int, micro_batch: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This data rank's micro-batches ``(input_ids [B, C], labels [B, C], instance ids [B], -1 for
    padding)``; every rank gets the same number."""
    n = rows.shape[0]
    per_rank = math.ceil(n / data_world)
    n_micro = max(1, math.ceil(per_rank / micro_batch))
    ids = np.arange(data_rank, n, data_world)
    padded = np.full(n_micro * micro_batch, -1, dtype=np.int64)
    padded[:ids.shape[0]] = ids
    out = []
    for a in range(0, padded.shape[0], micro_batch):
        sel = padded[a:a + micro_batch]
        data = np.zeros((micro_batch, rows.shape[1]), dtype=np.int64)
        data[sel >= 0] = rows[sel[sel >= 0]]
        x = torch.from_numpy(data[:, :-1].copy())
        y = torch.from_numpy(data[:, 1:].copy())
        y[torch.from_numpy(sel < 0)] = IGNORE_INDEX
        out.append((x, y, torch.from_numpy(sel)))
    return out


def _instance_ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row summed cross-entropy (fp64) and target-token counts of ``logits [B, C, V]``."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none").reshape(labels.shape)
    return ce.double().sum(1), (labels != IGNORE_INDEX).sum(1).double()


def evaluate(trainer: Any, rows: np.ndarray | dict[str, tuple[np.ndarray, float]]) -> dict[str, Any]:
    """Validation loss of ``trainer``'s current weights on ``rows`` (collective over the world). For a
    mixture's ``{name: (rows, weight)}``: ``val_loss/<name>`` per source, and ``val_loss`` their
    weighted mean (equal weights when every source with a split has weight 0)."""
    t0 = time.perf_counter()
    if not isinstance(rows, dict):
        return {**_evaluate_rows(trainer, rows), "val_s": time.perf_counter() - t0}
    res = {name: _evaluate_rows(trainer, r) for name, (r, _) in rows.items()}
    weights = {name: w for name, (_, w) in rows.items()}
    if sum(weights.values()) <= 0:
        weights = dict.fromkeys(weights, 1.0)
    loss = sum(weights[n] * r["val_loss"] for n, r in res.items()) / sum(weights.values())
    out = {"step": trainer.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)),
           "val_tokens": sum(r["val_tokens"] for r in res.values()),
           "val_instances": sum(r["val_instances"] for r in res.values())}
    out.update({f"val_loss/{n}": r["val_loss"] for n, r in res.items()})
    out["val_s"] = time.perf_counter() - t0  # the evaluation's wall time (summary.json's eval_s)
    return out


@torch.no_grad()
def _evaluate_rows(trainer: Any, rows: np.ndarray) -> dict[str, Any]:
    lay, cfg = trainer.layout, trainer.cfg
    device = trainer.device
    if cfg.eval.instances:
        rows = rows[:cfg.eval.instances]
    n = rows.shape[0]
    batches = rank_batches(rows, lay.data_rank, lay.data_world, cfg.eval.micro_batch)
    ce_N = torch.zeros(n, dtype=torch.float64, device=device)
    tok_N = torch.zeros(n, dtype=torch.float64, device=device)
    # TP ranks compute the same numbers: summed over the whole world (a pipeline's), count them once;
    # over the DP x EP group (one per TP rank) every rank counts, so every rank has the loss
    counts = trainer.pipeline is None or getattr(lay, "tp_rank", 0) == 0
    was_training = [m.training for m in _modules(trainer)]
    for m in _modules(trainer):
        m.eval()
    try:
        if trainer.pipeline is not None:
            produced = _pipeline_forward(trainer, batches)
        else:
            produced = []
            whole = is_fsdp(trainer.model)  # FSDP2 gathers the root's weights in the root's forward only
            eos = getattr(trainer, "document_eos", None)  # --data.document_mask: the same masking as training
            for x, y, sel in batches:
                x = x.to(device)
                kw = document_kwargs(x, eos)
                with trainer._autocast():
                    if whole:
                        logits = trainer.model(input_ids=x, use_cache=False, **kw).logits
                    else:
                        out = trainer.model.model(input_ids=x, use_cache=False, **kw)
                        logits = trainer.model.lm_head(out.last_hidden_state)
                produced.append((logits, y.to(device), sel))
        for logits, y, sel in produced:
            ce, tok = _instance_ce(logits, y)
            real = sel >= 0
            if counts and bool(real.any()):
                idx = sel[real].to(device)
                ce_N.index_add_(0, idx, ce[real.to(device)])
                tok_N.index_add_(0, idx, tok[real.to(device)])
    finally:
        for m, t in zip(_modules(trainer), was_training):
            m.train(t)
            reshard(m)  # FSDP2: a forward without backward leaves the root's weights gathered
    group = lay.world_group if trainer.pipeline is not None else lay.dpep_group
    both = torch.stack([ce_N, tok_N])
    all_reduce_sum(both, group)
    ce_sum = float(sum(both[0].cpu().tolist()))  # instance order, the same on every rank and layout
    tokens = int(round(float(both[1].sum().item())))
    loss = ce_sum / max(tokens, 1)
    return {"step": trainer.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "val_tokens": tokens,
            "val_instances": n}


def _modules(trainer: Any) -> list[torch.nn.Module]:
    return list(trainer.pipeline.modules) if trainer.pipeline is not None else [trainer.model]


def _pipeline_forward(trainer: Any, batches: list) -> list:
    """Forward-only pipeline: stage ``k`` receives each micro-batch's activations from stage
    ``k - 1``, runs its layers and sends to ``k + 1``; the last stage returns the logits."""
    pipe, lay = trainer.pipeline, trainer.layout
    if len(pipe.modules) != 1:
        raise NotImplementedError("evaluation under an interleaved pipeline (several stages per rank) is not supported")
    stage = pipe.modules[0]
    group = pp_group(lay)
    prev = dist.get_global_rank(group, pipe.pp_rank - 1) if not pipe.is_first else None
    nxt = dist.get_global_rank(group, pipe.pp_rank + 1) if not pipe.is_last else None
    device = trainer.device
    m = trainer.cfg.model
    hidden_dtype = next(stage.parameters()).dtype
    out = []
    for x, y, sel in batches:
        if pipe.is_first:
            inputs: tuple[torch.Tensor, ...] = (x.to(device),)
        else:
            h = torch.empty(x.shape[0], x.shape[1], m.hidden_size, dtype=torch.float32, device=device)
            extra = [torch.empty(m.num_experts, device=device), torch.empty(m.num_experts, device=device),
                     torch.empty(1, device=device)] if m.is_moe else []
            for t in (h, *extra):
                dist.recv(t, src=prev)
            inputs = (h.to(hidden_dtype), *extra)
        with trainer._autocast():  # every stage's rank holds the micro-batch: each finds the documents itself
            res = stage(*inputs, **document_kwargs(x.to(device), getattr(trainer, "document_eos", None)))
        if pipe.is_last:
            out.append((res[0], y.to(device), sel))
        else:
            for t in res:
                dist.send(t.float().contiguous(), dst=nxt)  # fp32 on the wire: autocast may give bf16
    return out

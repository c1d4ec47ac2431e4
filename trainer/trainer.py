"""The training loop: one :class:`Trainer` owns the layout, data, model, optimizer and metrics,
and composes the parallelisms the config asks for.

One step: every data-parallel rank takes its own micro-batches of the global batch; each
micro-batch's loss is normalised over the *global* batch (:mod:`trainer.model.loss`), so gradients are
plain sums across ranks and the logged loss is the global-batch mean whatever the layout. Then the
sharded optimizer reduces, clips (after warmup), updates and re-publishes the weights.

The parts, each applied by a function of :mod:`trainer.parallelism` when the config asks for it:

- ``--pp N`` (``parallel.pp``): this rank builds only its pipeline stage (the full model is never
  allocated when ``--parallel.pp_meta_init``), runs its micro-batches through the chosen schedule
  (``parallel.pp_schedule``: 1F1B by default, or GPipe), and the optimizer covers the stage's
  parameters with the same DP / EP groups (which all lie within one stage).
- ``--tp N`` (``parallel.tp``, dense model): attention heads and MLP columns split over the TP
  ranks (innermost in the mesh, where EP sits for MoE models); TP ranks read the same data.
- ``--ac norm,attn,moe`` (``parallel.ac``): selective activation checkpointing.
- ``--broadcast broadcast|all_reduce`` (``parallel.broadcast``): replicas receive rank 0's initial
  weights instead of drawing their own; with ``--init-from FILE`` (``model.init_from``) only rank 0
  reads the file and every rank receives its part.

The step is split into methods so that each part has one place: :meth:`build_model`,
:meth:`build_optimizer`, :meth:`forward_backward` (one rank's micro-batches, plain or through the
pipeline schedule), :meth:`optimizer_step`, and :meth:`state_dict` / :meth:`load_state_dict`
(everything needed to resume exactly).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn
import fastmoe_xpu
from fastmoe_xpu.compiling import compile_seconds
from fastmoe_xpu.dist.sharding import is_expert_weight

from .ft import fault
from .checkpoint.manager import CheckpointManager
from .checkpoint.optim_state import sync_master_from_model
from .checkpoint.restore import load_model
from .config import ConfigError, TrainConfig, validate, validated_for
from .layout import DeviceMesh, barrier, env_world_size, init_layout
from .model.documents import document_kwargs
from .model.loss import MicroLoss, all_reduce_loss, global_target_count, micro_batch_loss
from .records.metrics import MetricsWriter, MfuMeter, SpikeDetector, device_peak_tflops
from .model.build import build_model, flops_per_token, param_counts, torch_dtype
from .optim import BucketSpec, ZeroAdamW, build_optimizer, state_bytes_formula, state_bytes_per_param
from .parallelism.apply import parallelize
from .parallelism.broadcast import broadcast_replicas, load_and_broadcast, load_and_broadcast_local
from .parallelism.pipeline import Pipeline, parallelize_pipeline
from .parallelism.tp import tp_localize
from .optim.schedule import Schedule, check_resume, clipping_active
from .outputs.run_dir import check_data_set, check_run_dir, take_run_lease

from .data import ShardedLoader, ensure_default_dataset, manifest_eos_id, open_dataset


def document_eos(cfg: TrainConfig, manifest: dict[str, Any], path: str) -> int | None:
    """The EOS id ``--data.document_mask`` splits instances at, or None when it is off; a data set that records
    no EOS id is refused in one line naming the fix."""
    if not cfg.data.document_mask:
        return None
    eos = manifest_eos_id(manifest)
    if eos is None:
        raise ConfigError(f"--data.document_mask needs the end-of-document id, and data set {path} records none "
                          "(its manifest's tokenizer has no eos_id): make it again with fastmoe-preprocess, which "
                          "records it, or leave --data.document_mask out")
    return eos


@contextlib.contextmanager
def _weights_hold_still():  # noqa: ANN202
    """Where the weights hold still (a step's micro-batches, an evaluation), quantized expert weights
    (int8/fp8) are quantized once (:func:`fastmoe_xpu.frozen_expert_weights`). Their codes are
    forgotten before and after: an update, or an FSDP2 gather, writes new values into the same
    tensors, and a gather's writes need not move their version."""
    fastmoe_xpu.forget_quantized_weights()
    try:
        with fastmoe_xpu.frozen_expert_weights():
            yield
    finally:
        fastmoe_xpu.forget_quantized_weights()


class Trainer:
    """Trains ``cfg`` on this process's share of the layout, with the parallelisms it names (see the
    module doc; without any it is the plain data- and expert-parallel loop).

    ``layout`` defaults to the one torchrun's environment describes (one process without it).
    ``cfg`` is used as it is when :func:`trainer.config.validate` passed it for this world (the
    CLI's), else a validated copy is."""

    def __init__(self, cfg: TrainConfig, layout: DeviceMesh | None = None) -> None:
        # a bad --out fails here, in one line, before any process group or model exists
        fault.check_out_dir(cfg.logging.out)
        world = layout.world if layout is not None else env_world_size()
        if not validated_for(cfg, world):
            # a config built in code rather than by the CLI: check a copy, the caller's stays as it was
            cfg = validate(copy.deepcopy(cfg), world)
        self.cfg = cfg
        check_run_dir(cfg)  # another run in --out, or an export over the run: refused before any work
        # one job writes --out at a time: another live job's lease is refused here, a gone one's taken over
        self._rank = layout.rank if layout is not None else int(os.environ.get("RANK", "0"))
        self.lease = take_run_lease(cfg.logging.out, self._rank)  # None: the CLI's, joined, or not rank 0
        if layout is None:
            layout = init_layout(cfg.parallel)
        self.layout = layout
        self.pipeline: Pipeline | None = None
        lay = self.layout
        m, s = cfg.model, cfg.schedule
        self.device = lay.device
        self.out_dir = cfg.logging.out

        # data first: a missing or corrupt data set fails here, before the model is built
        self.manifest_path = self._prepare_data()
        dataset = open_dataset(self.manifest_path, verify=cfg.data.verify, seed=cfg.data.seed)
        manifest = dataset.manifest
        if int(manifest["context"]) != cfg.data.context:
            raise ConfigError(
                f"data set {self.manifest_path} has context {manifest['context']}, --data.context asks for "
                f"{cfg.data.context}; leave --data.context (--context) out to train at the data set's, or "
                f"preprocess again with --context {cfg.data.context}")
        #: --data.document_mask: the EOS id that ends each document (None: attention spans the whole instance)
        self.document_eos = document_eos(cfg, manifest, self.manifest_path)
        data_vocab = self.data_vocab = int(manifest["tokenizer"]["vocab_size"])
        if m.vocab_size == 0:
            m.vocab_size = data_vocab
        elif m.vocab_size < data_vocab:
            raise ConfigError(f"model vocab_size {m.vocab_size} is smaller than the tokenizer's {data_vocab}")
        self.loader = ShardedLoader(dataset, s.global_batch, s.micro_batch,
                                    dp_rank=lay.data_rank, dp_size=lay.data_world, verify=cfg.data.verify)

        self.model = self.build_model()
        self.model.train()
        from .optim.fsdp import is_fsdp

        self.fsdp = is_fsdp(self.model)  # --parallel.dp_shard fsdp on more than one rank
        self.hf = None  # arch="hf": the family's loss, expert loads and router bias (trainer/model/family.py)
        if m.is_hf:
            from .model.family import HfMoeRun

            self.hf = HfMoeRun(self.model, m, self.device)
            if self.pipeline is not None:
                pipe = self.pipeline
                self.hf.paused = lambda: pipe.inferring
        self.lora_config = None  # --lora.rank: PEFT adapters on the expert weights, the rest frozen (trainer/model/lora.py)
        if cfg.lora.rank > 0:
            from .model.lora import apply_lora

            self.lora_config = apply_lora(self.model, cfg.lora)
        self.optimizer: ZeroAdamW = self.build_optimizer()
        self.schedule = Schedule(s, cfg.optim.lr)
        self.step = 0
        ck = cfg.checkpoint
        self.checkpoints = CheckpointManager(
            ck.dir or os.path.join(self.out_dir, "checkpoints"), layout=lay, interval=ck.interval,
            model_interval=ck.model_interval, model_dtype=ck.model_dtype, is_expert=is_expert_weight,
            allow_fresh_start=ck.allow_fresh_start, failures_dir=self.out_dir, async_save=ck.async_save)
        if ck.init_from:
            load_model(ck.init_from, self.model, layout=lay, is_expert=is_expert_weight)
            sync_master_from_model(self.optimizer)
        self.heartbeat = fault.Heartbeat(self.out_dir, lay.rank)
        self._local_loss = torch.zeros(())
        self.spikes = SpikeDetector(cfg.logging.spike_window, cfg.logging.spike_factor)
        self.counts = param_counts(m)
        self.flops_per_token = flops_per_token(m, cfg.data.context)
        self.micro_batches_global = s.global_batch // s.micro_batch
        self.tokens_per_step = s.global_batch * cfg.data.context
        self._autocast_dtype = self._resolve_autocast()
        self.peak_tflops, self.peak_source = (0.0, "")
        self.mfu: MfuMeter | None = None  # rank 0's, from fit()
        self.writer: MetricsWriter | None = None
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}  # summary.json's contents once written (rank 0)
        self.stop: Any = None  # a trainer.ft.stop.StopRequest (the CLI's): signals end the run after a step
        self._last_full: tuple[int, str] | None = None  # (step, path) of the newest full checkpoint written
        self._init_extras()

    # ------------------------------------------------------------------------------ setup
    def build_model(self) -> nn.Module:
        """This rank's model (its pipeline stage under PP, its experts under EP, its TP shard under
        TP), identical weights on every replica."""
        cfg, lay = self.cfg, self.layout
        p = cfg.parallel
        # FSDP2 shards the weights as they are: they are made final (--init-from, --broadcast) first
        early = p.dp_shard == "fsdp" and lay.dpep_group is not None

        def prepare(module: nn.Module) -> None:
            # TP -> EP -> activation checkpointing -> FSDP2 -> compile (traced at the first call,
            # after the weights below are final)
            parallelize(module, lay, cfg, before_shard=self._synchronise_weights if early else None)

        if p.pp > 1:
            self.pipeline = parallelize_pipeline(cfg, lay, self.device,
                                                 lambda stage: self._full_model(meta=p.pp_meta_init), prepare)
            model: nn.Module = self.pipeline.modules[0]
            model.to(dtype=torch_dtype(cfg.model.param_dtype))
        else:
            model = self._full_model()
            prepare(model)
        if not early:
            self._synchronise_weights(model)
        return model

    def _full_model(self, *, meta: bool = False) -> nn.Module:
        cfg, lay = self.cfg, self.layout
        device = torch.device("meta") if meta else self.device
        if meta:
            with torch.device("meta"):
                return build_model(cfg.model, cfg.data.context, seed=cfg.seed, device=device,
                                   ep_group=lay.ep_group, ep_size=lay.ep)
        return build_model(cfg.model, cfg.data.context, seed=cfg.seed, device=device,
                           ep_group=lay.ep_group, ep_size=lay.ep)

    def _synchronise_weights(self, model: nn.Module) -> None:
        """``--init-from``: rank 0 reads the file, every rank receives its part. ``--broadcast``
        without a file: every replica takes its group's first rank's initial weights."""
        cfg, lay = self.cfg, self.layout
        method = cfg.parallel.broadcast
        path = cfg.model.init_from
        if path:
            if not lay.distributed:
                load_and_broadcast_local(model, path)
                return
            tp = lay.tp
            load_and_broadcast(model, path, group=None, method="broadcast" if method == "none" else method,
                               localize=tp_localize(lay.tp_rank, tp) if tp > 1 else None)
        elif method != "none" and lay.dpep_group is not None:
            broadcast_replicas(model, group=lay.dpep_group, expert_group=lay.dp_group, method=method,
                               is_expert=is_expert_weight)

    def build_optimizer(self) -> ZeroAdamW:
        o, lay = self.cfg.optim, self.layout
        tp = lay.tp
        if self.cfg.parallel.dp_shard == "fsdp" and lay.dpep_group is not None:
            from .optim.fsdp import FsdpAdamW

            return FsdpAdamW(self.model.named_parameters(), is_expert=is_expert_weight, dp_group=lay.dp_group,
                             norm_group=lay.world_group, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay, grad_reduce_dtype=torch_dtype(o.grad_reduce_dtype))
        if tp == 1:
            return build_optimizer(
                o.name, self.model, lay, is_expert=is_expert_weight, betas=(o.beta1, o.beta2), eps=o.eps,
                weight_decay=o.weight_decay, grad_reduce_dtype=torch_dtype(o.grad_reduce_dtype),
                **self.master_options(),
            )
        # TP-split weights are distinct on every TP rank; replicated ones (embedding, LM head) are
        # equal there, gradients included, so only TP rank 0 counts them in global norms.
        split, replicated = [], []
        for name, prm in self.model.named_parameters():
            if prm.requires_grad:
                (split if getattr(prm, "tp_split", False) else replicated).append((name, prm))
        sharded = o.name != "adamw"
        specs = [BucketSpec("tp_split", split, lay.dp_group if sharded else None,
                            None if sharded else lay.dp_group, True),
                 BucketSpec("tp_replicated", replicated, lay.dp_group if sharded else None,
                            None if sharded else lay.dp_group, lay.tp_rank == 0)]
        return ZeroAdamW(specs, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                         grad_reduce_dtype=torch_dtype(o.grad_reduce_dtype), norm_group=lay.world_group,
                         **self.master_options())

    def master_options(self) -> dict[str, Any]:
        """Where the optimizer keeps the weights (``--optim.stochastic_rounding``,
        ``--optim.master_weights``, ``--optim.moments_dtype``); the rounding generator is seeded per
        rank from the run's seed."""
        o = self.cfg.optim
        master = "stochastic" if o.stochastic_rounding else "fp32" if o.master_weights else "none"
        return dict(master=master, moments_dtype=torch_dtype(o.moments_dtype),
                    rounding_seed=self.cfg.seed * 100003 + self.layout.rank)

    def _prepare_data(self) -> str:
        d = self.cfg.data
        if d.path is not None:
            return d.path
        # rank 0 builds the embedded corpus; the others wait and reuse it
        path = None
        if self.layout.is_main:
            path = ensure_default_dataset(d.cache_dir, d.context, d.seed, progress=self.cfg.logging.progress,
                                          valid=d.valid)
        barrier(self.layout)
        if path is None:
            path = ensure_default_dataset(d.cache_dir, d.context, d.seed, progress=False, valid=d.valid)
        return path

    def _resolve_autocast(self) -> torch.dtype | None:
        a = self.cfg.model.autocast
        if a == "none" or (a == "auto" and self.device.type == "cpu"):
            return None
        return torch.bfloat16

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    # ------------------------------------------------------------------------------ one step
    def micro_batch_loss(self, logits: torch.Tensor, labels: torch.Tensor,
                         router_logits: Sequence[torch.Tensor] | None, global_targets: float) -> tuple[torch.Tensor, MicroLoss]:
        """The loss of one micro-batch (see :func:`trainer.model.loss.micro_batch_loss`)."""
        return micro_batch_loss(self.cfg.model, logits, labels, router_logits, global_targets=global_targets,
                                micro_batches_global=self.micro_batches_global)

    def forward_backward(self, micro_batches: Sequence[Any]) -> MicroLoss:
        """Forward and backward over this rank's micro-batches (through the pipeline schedule under
        PP); gradients accumulate in the optimizer's flat buffers. Returns the global sums."""
        global_targets = global_target_count(micro_batches, self.layout.dpep_group, self.device)
        if self.pipeline is not None:
            return self._pipeline_forward_backward(micro_batches, global_targets)
        if self.hf is not None:
            return self.hf.forward_backward(self, micro_batches, global_targets)
        acc: MicroLoss | None = None
        want_router = self.cfg.model.is_moe
        for mb in micro_batches:
            input_ids = mb[0].to(self.device, non_blocking=True)
            labels = mb[1].to(self.device, non_blocking=True)
            with self._autocast():
                kw = {"output_router_logits": True} if want_router else {}
                kw.update(document_kwargs(input_ids, self.document_eos))
                if self.fsdp:  # the root's forward gathers the embedding, final norm and head
                    out = self.model(input_ids=input_ids, use_cache=False, **kw)
                    logits = out.logits
                else:
                    out = self.model.model(input_ids=input_ids, use_cache=False, **kw)
                    logits = self.model.lm_head(out.last_hidden_state)
            router_logits = getattr(out, "router_logits", None) if want_router else None
            loss, parts = self.micro_batch_loss(logits, labels, router_logits, global_targets)
            loss.backward()
            self._local_loss = loss.detach() if acc is None else self._local_loss + loss.detach()
            acc = parts if acc is None else acc + parts
        assert acc is not None  # micro_batches is never empty (validated batch sizes)
        # the sums over DP x EP
        m = self.cfg.model
        return all_reduce_loss([acc], m.num_experts if m.is_moe else 0, self.layout.dpep_group, self.device)

    def _pipeline_forward_backward(self, micro_batches: Sequence[Any], global_targets: float) -> MicroLoss:
        lay, m, pipe = self.layout, self.cfg.model, self.pipeline
        assert pipe is not None and pipe.loss_cfg is not None
        lc = pipe.loss_cfg
        lc.global_targets = global_targets
        lc.micro_batches_global = self.micro_batches_global
        input_ids = torch.cat([mb[0] for mb in micro_batches]).to(self.device)
        labels = torch.cat([mb[1] for mb in micro_batches]).to(self.device)
        # every stage's rank reads the same micro-batches: each computes the document positions itself
        kw = document_kwargs(input_ids, self.document_eos)
        with self._autocast():
            parts = pipe.step(input_ids if pipe.is_first else None, labels if pipe.is_last else None, **kw)
        counts = getattr(lay, "tp_rank", 0) == 0  # TP ranks compute the same loss: count it once
        # parts is empty except on the last stage, whose DP x EP ranks hold the global sums
        return all_reduce_loss(parts if counts else [], m.num_experts if m.is_moe else 0, lay.world_group,
                               self.device)

    def optimizer_step(self) -> dict[str, Any]:
        s, o = self.cfg.schedule, self.cfg.optim
        lr = self.schedule.lr(self.step)
        clip = o.grad_clip if (o.grad_clip > 0 and clipping_active(self.step, s.warmup_steps)) else None
        norms = self.optimizer.step(lr, clip)
        return {"lr": lr, "clip": clip, **norms}

    def train_step(self) -> dict[str, Any]:
        """One optimizer step on the next global batch; returns its metrics record."""
        m = self.cfg.model
        t0 = time.perf_counter()
        c0 = compile_seconds()
        micro = self.loader.next_batch()
        with _weights_hold_still():  # quantized by the first micro-batch's forward, not by every one
            parts = self.forward_backward(micro)
        # NaN/Inf on any rank stops every rank here, before the update (raises fault.SoftFailure)
        grads = [b.flat_grad for b in self.optimizer.buckets]
        local_loss = fault.maybe_poison(self._local_loss, self.step, self.layout.rank, grads)  # test hook
        fault.check_step(self.step, local_loss, grads, out_dir=self.out_dir)
        upd = self.optimizer_step()
        if self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize()
        # Compilation (first steps under --compile) is reported apart, not as step time.
        compile_s = compile_seconds() - c0
        dt = max(time.perf_counter() - t0 - compile_s, 1e-9)
        self.step += 1
        lm, lb, z = (float(parts.lm), float(parts.lb), float(parts.z))
        loss = lm + (m.load_balancing_coef * lb + m.z_loss_coef * z if m.is_moe or m.is_hf else 0.0)
        spike, running = self.spikes.update(upd["grad_norm"])
        tok_s = self.tokens_per_step / dt
        rec: dict[str, Any] = {
            "step": self.step, "loss": loss, "lm_loss": lm, "lb_loss": lb, "z_loss": z, "lr": upd["lr"],
            "grad_norm": upd["grad_norm"], "grad_norm_mean": running if math.isfinite(running) else None, "grad_clipped": bool(
                upd["clip"] is not None and upd["grad_norm"] > upd["clip"]),
            "grad_spike": spike, "grad_spikes": self.spikes.count, "param_norm": upd["param_norm"],
            "tokens": self.step * self.tokens_per_step, "step_time_s": dt, "tokens_per_s": tok_s,
            "compile_s": compile_s,
        }
        if self.mfu is not None:
            rec["mfu"] = self.mfu(tok_s)  # never above 1 (trainer/records/metrics.py: MfuMeter)
        if m.is_moe:
            tpe = (parts.tokens_per_expert / m.num_layers).tolist()
            rec["tokens_per_expert"] = tpe
            mean = sum(tpe) / len(tpe)
            rec["expert_load_max_over_mean"] = max(tpe) / mean if mean > 0 else 0.0
        if self.hf is not None:  # per-expert load and the router bias update (after the weights moved)
            rec.update(self.hf.end_step(self.layout.dpep_group, self._stages_group()))
        return rec

    # ------------------------------------------------------------------------------ the run
    def fit(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Train until step ``steps`` (default: the config's), writing metrics on rank 0."""
        cfg, lay = self.cfg, self.layout
        total = cfg.schedule.steps if steps is None else steps
        if self.lease is None:  # fit() again after the lease of the last went
            self.lease = take_run_lease(self.out_dir, self._rank)
        if cfg.checkpoint.resume and self.step == 0 and self.resume() and self.step >= total and lay.is_main:
            print(f"{self.out_dir}: already complete at step {self.step}; nothing to train (a larger --steps with "
                  f"--reschedule trains on, another --out starts a new run)", flush=True)
        if lay.is_main:
            self.peak_tflops, self.peak_source = device_peak_tflops(self.device, cfg.logging.peak_tflops)
            self.mfu = MfuMeter(self.peak_tflops, self.peak_source, self.flops_per_token, lay.world)
            wandb = dict(project=cfg.logging.wandb_project, config=cfg.to_dict()) if cfg.logging.wandb else None
            self.writer = MetricsWriter(self.out_dir, tensorboard=cfg.logging.tensorboard, append=self.step > 0,
                                        start_step=self.step, wandb=wandb)
            self._write_run_info()
            from .checkpoint.writers import checkpoint_space_warning
            from .records.startup import startup_summary

            print(startup_summary(self, [checkpoint_space_warning(self)]), flush=True)
        bar = None
        if lay.is_main and cfg.logging.progress:
            from .records.progress import progress_bar

            bar = progress_bar(total=total, initial=self.step, desc=cfg.preset, unit="step")
        stop, stopped = self.stop, None
        from fastmoe_xpu.threads import Adapter

        from .records.events import RunEvents

        events = RunEvents(self)
        self.fit_started = time.perf_counter()  # summary.json's wall_s runs from here

        threads = Adapter()  # a default thread figure follows other work on the machine (fastmoe_xpu/threads.py)
        if stop is not None:
            stop.deferred = True  # a signal from here on lets the step finish
        try:
            while self.step < total:
                fault.maybe_hang(self.step, lay.rank)
                self.heartbeat.beat(self.step, "start")
                rec = self.train_step()
                rec.update(self.step_extras(total))
                self.heartbeat.beat(self.step, "done", completed=True)
                rec.update(self.save_checkpoints())  # its stall and write times go on the step's record
                self.history.append(rec)
                if self.writer is not None:
                    self.writer.write(rec)
                if bar is not None:  # this step's numbers first: update() draws (or prints) the line
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                    spikes=rec["grad_spikes"], refresh=False)
                    bar.update(1)
                if self.writer is not None:  # rank 0: validation, checkpoints, schedule phases, said now
                    for line in events.lines(rec):
                        events.say(bar, line)
                moved = threads.step()
                if moved is not None and lay.is_main:
                    (bar.write if hasattr(bar, "write") else print)(moved)
                if stop is not None:
                    stopped = stop.agreed(lay.world_group, lay.distributed, self.device)
                    if stopped is not None:
                        break
        finally:
            if stop is not None:
                stop.deferred = False  # a signal from here on stops at once
                stop.phase = f"after the last step ({self.step}); the newest checkpoint stays, the run's end was cut short"
            if bar is not None:
                bar.close()
            if self.writer is not None:
                self.writer.close()
        if stopped is not None or self.step >= cfg.schedule.steps:  # every run keeps its model (fit(n) goes on)
            path = self.artefacts["checkpoint"] = self.stop_checkpoint()
        if stopped is not None:
            if lay.is_main:
                self._write_summary()
            from .ft.stop import Stopped, signal_name

            raise Stopped(stopped, f"stopped at step {self.step} ({signal_name(stopped)}); checkpoint at {path}; "
                                   f"run the same command to resume")
        if lay.is_main:
            self._write_summary()
        self.finish_run()
        self.release_lease()  # the run directory is free for another job until fit() is called again
        return self.history

    def release_lease(self) -> None:
        """Give up this Trainer's lease on its run directory (taken when it was built; fit() takes it
        again). A Trainer dropped without fit() gives it up when collected, not at the process's end."""
        lease, self.lease = getattr(self, "lease", None), None
        if lease is not None:
            lease.release()

    def __del__(self) -> None:
        try:
            self.release_lease()
        except Exception:  # interpreter shutdown: the lease's own atexit hook gives it up
            pass

    def stop_checkpoint(self) -> str:
        """The full checkpoint of the step the run ends on, by a stop signal or at its last step
        (the one written or resumed from at this step when there is one; collective)."""
        self.checkpoints.wait()  # a background write of this step or an earlier one finishes first
        if self._last_full is not None and self._last_full[0] == self.step:
            return self._last_full[1]
        self.heartbeat.beat(self.step, "checkpoint")
        st = self.checkpoints.save(self.step, self.model, self.optimizer, meta=self._full_meta(), background=False)
        self._last_full = (self.step, str(st.path))
        return self._last_full[1]

    def run_records(self) -> list[dict[str, Any]]:
        """Every step's record of the whole run, earlier runs on this ``--out`` included when this
        one resumed (from metrics.jsonl, one record per step); this process's records where that
        file is not written."""
        path = os.path.join(self.out_dir, "metrics.jsonl")
        if self.writer is None or not os.path.isfile(path):
            return list(self.history)
        from .records.metrics import read_metrics

        by_step = {int(r["step"]): r for r in read_metrics(path) if "step" in r and int(r["step"]) <= self.step}
        return [by_step[k] for k in sorted(by_step)]

    # ------------------------------------------------------------------------------ evaluation and artefacts
    def _init_extras(self) -> None:
        """The validation split and the MoE health hooks (see :mod:`trainer.outputs.evaluate`, :mod:`trainer.records.moe_health`)."""
        from .outputs.evaluate import load_data_validation
        from .records.moe_health import MoeHealth

        cfg = self.cfg
        self.val_rows = load_data_validation(self.loader.dataset, verify=cfg.data.verify) \
            if cfg.eval.enabled else None
        self.eval_history: list[dict[str, Any]] = []
        self.moe_health: MoeHealth | None = None
        if cfg.model.is_moe and cfg.eval.moe_health:
            mods = list(self.pipeline.modules) if self.pipeline is not None else [self.model]
            self.moe_health = MoeHealth(mods, cfg.model.num_layers, cfg.model.num_experts, cfg.model.top_k, self.device)
            if self.pipeline is not None:
                pipe = self.pipeline
                self.moe_health.paused = lambda: pipe.inferring
        self.artefacts: dict[str, Any] = {}

    def step_extras(self, total: int) -> dict[str, Any]:
        """MoE health of the step just taken, and the validation loss when due (collective)."""
        out: dict[str, Any] = {}
        if self.moe_health is not None:
            group = self.layout.world_group if self.pipeline is not None else self.layout.dpep_group
            out.update(self.moe_health.collect(group))
        iv = self.cfg.eval.interval
        if self.val_rows is not None and (self.step == total or (iv > 0 and self.step % iv == 0)):
            out.update(self.evaluate())
        return out

    def evaluate(self) -> dict[str, Any]:
        """Loss and perplexity on the validation split (collective; see :func:`trainer.outputs.evaluate.evaluate`)."""
        from .outputs.evaluate import evaluate

        if self.val_rows is None:
            raise ValueError(f"data set {self.manifest_path} keeps no validation split (preprocess with --valid)")
        if self.moe_health is not None:
            self.moe_health.enabled = False
        try:
            with _weights_hold_still():  # quantized once for all its batches, not per batch
                res = evaluate(self, self.val_rows)
        finally:
            if self.moe_health is not None:
                self.moe_health.enabled = True
        self.eval_history.append(res)
        return {k: v for k, v in res.items() if k != "step"}

    def finish_run(self) -> None:
        """End-of-run artefacts: MoE charts; with ``--eval.export_hf`` the transformers export
        (from an fp32 model-only checkpoint) and generated samples; a summary of the paths (rank 0)."""
        from .outputs.run_end import finish_run

        if self.lora_config is not None and self.layout.is_main:
            from .model.lora import export_adapter

            self.artefacts["lora_adapter"] = export_adapter(
                self.model, self.lora_config, self.cfg.lora.export or os.path.join(self.out_dir, "lora"))
        finish_run(self)

    def resume(self) -> bool:
        """Continue from the newest valid full checkpoint, if any: weights, optimizer shards and
        steps, data position, spike history, and (same layout) RNG states. Returns whether it did."""
        res = self.checkpoints.restore(self.model, self.optimizer)
        if res is None and self.cfg.checkpoint.resume_from:  # another run's: read, never written to
            res = self.checkpoints.restore(self.model, self.optimizer, info=self._resume_source())
        if res is None:
            return False
        meta = res.meta
        check_data_set(meta, res.info.step, str(res.info.path), self.loader.dataset.fingerprint, self.manifest_path)
        self._check_schedule(meta.get("config"), res.info.step, str(res.info.path))
        self.step = res.info.step
        self._last_full = (self.step, str(res.info.path))
        self.loader.load_state_dict(meta["data"])
        self.spikes.load_state_dict(meta["spikes"])
        if self.hf is not None:
            self.hf.load_state(meta.get("router_bias"))
        if self.layout.is_main:
            print(f"resumed from {res.info.path} at step {self.step} ({res.seconds:.2f}s"
                  f"{'' if res.same_layout else ', new layout: RNG states not restored'})", flush=True)
        return True


    def _check_schedule(self, saved: dict[str, Any] | None, step: int, path: str) -> None:
        """A resume on another schedule than the checkpoint's: see :func:`trainer.optim.schedule.check_resume`."""
        line = check_resume(self.cfg, saved, step, path)
        if line is not None and self.layout.is_main:
            print(line, flush=True)

    def _resume_source(self) -> Any:
        """The full checkpoint ``--checkpoint.resume_from`` names: that slot, or the newest valid one
        of a checkpoint directory or of a run's --out (verified by rank 0)."""
        from .checkpoint.dcp_io import broadcast_object
        from .checkpoint.slots import CheckpointError, latest_valid, read_info, verify

        path = Path(self.cfg.checkpoint.resume_from)
        found: Any = None
        if self.layout.rank == 0:
            found = (read_info(path) if verify(path) is None else latest_valid(path)
                     or latest_valid(path / "checkpoints") or f"{path} holds no valid full checkpoint")
        found = broadcast_object(found)
        if isinstance(found, str):
            raise CheckpointError(f"--checkpoint.resume_from: {found}")
        return found

    def save_checkpoints(self) -> dict[str, Any]:
        """The full checkpoint and/or model-only checkpoint due at this step (collective); the
        checkpoint timings for the step's record (:meth:`CheckpointManager.pop_fields`)."""
        ck = self.checkpoints
        ck.poll()
        if ck.due(self.step):
            self.heartbeat.beat(self.step, "checkpoint")
            st = ck.save(self.step, self.model, self.optimizer, meta=self._full_meta())
            self._last_full = (self.step, str(st.path))
        if ck.model_due(self.step):
            self.heartbeat.beat(self.step, "checkpoint")
            ck.save_model(self.step, self.model, meta={"preset": self.cfg.preset, **self._export_meta()})
        return ck.pop_fields()

    def _full_meta(self) -> dict[str, Any]:
        return {"data": self.loader.state_dict(), "spikes": self.spikes.state_dict(), **self._export_meta()}

    def _export_meta(self) -> dict[str, Any]:
        """What ``fastmoe-export`` needs beside the weights: the config and the tokenizer
        (under keys of their own, so a resume's ``meta["data"]`` stays the loader position)."""
        meta = {"config": self.cfg.to_dict(), "tokenizer": self.loader.dataset.manifest["tokenizer"],
                "data_manifest": self.manifest_path}
        if self.hf is not None:
            # the family's config as built (a --model.hf_config file need not exist at export time)
            meta["hf_config"] = self.model.config.to_dict()
            bias = self.hf.state(self._stages_group())  # buffers: the weights segments do not carry them
            if bias:
                meta["router_bias"] = bias
        return meta

    def _stages_group(self) -> Any:
        """The pipeline group under PP (the family statistics gather over it), else None."""
        from .layout import pp_group

        return pp_group(self.layout) if self.pipeline is not None else None

    def _write_run_info(self) -> None:
        cfg, lay = self.cfg, self.layout
        info = {
            "config": cfg.to_dict(),
            "layout": {"world": lay.world, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "tp": lay.tp,
                       "device": str(self.device)},
            "data": self.manifest_path,
            "params": {"total": self.counts.total, "active": self.counts.active, "embedding": self.counts.embedding,
                       "expert": self.counts.expert},
            "flops_per_token": self.flops_per_token,
            "peak_tflops_per_device": self.peak_tflops, "peak_source": self.peak_source,
            "optimizer_state_bytes_rank0": self.optimizer.state_bytes(),
            "optimizer_state_bytes_formula": self.state_bytes_formula(),
            "tensorboard": bool(self.writer and self.writer.tensorboard_enabled),
        }
        with open(os.path.join(self.out_dir, "run.json"), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)

    def _write_summary(self) -> None:
        """summary.json and loss.png over the whole run (:func:`trainer.records.summary.write_summary`)."""
        from .records.summary import write_summary

        self.summary = write_summary(self)

    # ------------------------------------------------------------------------------ accounting
    def local_param_counts(self) -> tuple[int, int]:
        """(non-expert, expert) parameters this rank holds (whole weights, FSDP2's included)."""
        dense = sum(p.numel() for n, p in self.model.named_parameters() if not is_expert_weight(n))
        expert = sum(p.numel() for n, p in self.model.named_parameters() if is_expert_weight(n))
        return dense, expert

    def state_bytes_formula(self) -> int:
        dense, expert = self.local_param_counts()
        if self.fsdp:  # the states of this rank's FSDP2 shards, and of its expert shard over DP
            local = sum(p.to_local().numel() for n, p in self.model.named_parameters() if not is_expert_weight(n))
            return 12 * (local + math.ceil(expert / self.layout.dp))
        return state_bytes_formula(self.cfg.optim.name, dense, expert, self.layout.dp, self.layout.ep,
                                   state_bytes_per_param(**{k: v for k, v in self.master_options().items()
                                                            if k != "rounding_seed"}))

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to continue exactly: weights, optimizer shards, step, data
        position, RNG states, spike history."""
        lay = self.layout
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                               "python": random.getstate()}
        if self.device.type in ("cuda", "xpu"):
            rng[self.device.type] = getattr(torch, self.device.type).get_rng_state(self.device)
        return {
            "step": self.step,
            "layout": {"world": lay.world, "rank": lay.rank, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep},
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "data": self.loader.state_dict(),
            "rng": rng,
            "spikes": self.spikes.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        lay = self.layout
        want = {"world": lay.world, "rank": lay.rank, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep}
        if state["layout"] != want:
            raise ValueError(f"state was saved by layout {state['layout']}, this process is {want}")
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["data"])
        self.step = int(state["step"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if self.device.type in rng:
            getattr(torch, self.device.type).set_rng_state(rng[self.device.type], self.device)
        self.spikes.load_state_dict(state["spikes"])



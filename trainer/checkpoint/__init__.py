"""Checkpoints: two alternating full-state slots, persistent model-only snapshots, DP-scattered
writes, and resuming on a different data-parallel size.

On disk, under the checkpoint root (``OUT/checkpoints`` by default)::

    slot-A/  slot-B/         full training state; checkpoint index k goes to slot "AB"[k % 2]
      .metadata              torch.distributed.checkpoint (DCP) index of every tensor key
      __<rank>_0.distcp      DCP data, one file per rank that writes something
      rank-<rank>.pt         that rank's RNG states (python, numpy, torch, accelerator) and extras
      meta.json              step, checkpoint index, layout, optimizer steps, the caller's metadata
      MANIFEST.json          sha256 and size of every other file, written last
    model-step-<step>/       model-only checkpoints, kept forever (same files, no optimizer state)
    slot-A.tmp/ ...          a write in progress: ignored by readers, removed by the next write

A write is atomic: everything goes into ``<name>.tmp``, every file and the directory are fsynced,
the manifest is written last, and only then is the directory renamed into place (and its parent
fsynced). Before slot A is reused its old contents are deleted, so at most two full checkpoints
occupy the disk, and a crash (or a full disk) while writing A leaves slot B, the newest complete
checkpoint, untouched. :func:`latest_valid` returns the newest slot whose manifest verifies:
missing, truncated or bit-flipped files disqualify a slot.

Key scheme (whole tensors keyed by name, so any layout can read any checkpoint; under
``--parallel.dp_shard fsdp`` a sharded weight and its states are saved as DTensors under the same
keys: every rank writes its own shard, DCP's index records the pieces, and a reader asks for the
whole tensor or its own part of it):

``model/<param>``
    a non-expert weight, whole, in the parameter dtype (or bf16 for model-only snapshots);
``model/<param>/<e>``
    global expert ``e``'s slice of a merged expert weight (``experts.gate_up_proj [E, 2I, H]`` ->
    ``[2I, H]``); global ids come from the block's ``experts.expert_ids`` buffer under EP;
``optim/<state>/<param>[/<e>]``
    the *unsharded* fp32 optimizer state of that weight, ``<state>`` in master / exp_avg /
    exp_avg_sq. Each rank owns a contiguous shard of a flat buffer of parameters; a weight that
    straddles shard boundaries is assembled (point-to-point sends) on the rank holding its first
    element, which writes it. On load, each rank reads the weights overlapping its new shard and
    copies out its slice, so DP (and EP, when E stays divisible) may differ from the saving run.

Writers: model-parallel shard ``m = pp_rank * EP + ep_rank`` is written by the rank with those
coordinates and ``dp_rank = m % DP`` (:func:`model_shard_writer`), so model writes spread across
nodes rather than all landing on DP rank 0. Non-expert weights, replicated on all EP ranks of a
stage, are split among that stage's EP shards by size (:func:`balance`). When DP exceeds the
number of shards (``PP*EP``; EP=1 runs have a single shard), each shard is further cut into
``DP // (PP*EP)`` size-balanced chunks written by DP ranks ``(m + j*PP*EP) % DP`` (chunk 0 by the
shard writer), so every node writes a share. Optimizer states are unique per shard and written by
their owners; replicas of a state (EP replicas under ShardedAdamW, every rank under the
replicated AdamW) take turns weight by weight. FSDP2 shards (weights and their states) are written
by every rank that holds one, replicas of an HSDP shard once (DCP keeps one copy of identical pieces).

Modules: :mod:`.slots` (the directories, atomic files, the manifest, verification), :mod:`.writers`
(coordinates, the writer plan, segments), :mod:`.optim_state` (the optimizer's shards),
:mod:`.dcp_io` (DCP reads and writes, the ranks' agreement), :mod:`.save`, :mod:`.restore` and
:mod:`.manager` (:class:`~trainer.checkpoint.manager.CheckpointManager`, what the trainer uses).
"""

"""Fault tolerance of the trainer, in one place (as torchtitan keeps ``components/ft``).

- :mod:`.launch`: ``fastmoe-launch``, the per-node launcher on torch's elastic agent: spares, blame,
  fatal codes, the quorum deadline, stopping the whole job by signal, the job's last line; its
  machinery is in :mod:`.elastic` (the job's state, the agent, one node, K nodes on one machine);
- :mod:`.local_launch`: ``fastmoe-train --nproc-per-node N`` (torchrun's launcher in-process);
- :mod:`.fault`: the NaN/Inf check before every update, heartbeats, fault-injection hooks, exit codes;
- :mod:`.records`: ``failures.jsonl`` and the heartbeat files shared by every rank and node;
- :mod:`.watchdog`: the in-worker watchdog that turns a hang into an exit and names the culprit;
- :mod:`.stop`: SIGINT / SIGTERM: finish the step, one checkpoint, one line;
- :mod:`.bench`: checkpoint and recovery measurements; :mod:`.soak`: a multi-node job under a
  schedule of faults, with figures and a timeline.

Checkpoints themselves are :mod:`trainer.checkpoint`. Everything is described in docs/fault.md.
"""

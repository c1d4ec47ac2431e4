"""The node launcher's machinery on torch's elastic agent (``fastmoe-launch``'s command line is
:mod:`trainer.ft.launch`): :mod:`.job` (exit codes, options, events, the job's state in the store),
:mod:`.agent` (the rendezvous corrections and the node agent), :mod:`.node` (one node launcher, the
store process) and :mod:`.local_nodes` (K nodes on one machine)."""

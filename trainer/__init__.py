"""trainer: pretraining of OLMoE / OLMo models with FastSparseMoE, sharded AdamW and EPSO.

Entry points: ``fastmoe-train --preset tiny-moe`` (trainer.cli), :class:`trainer.trainer.Trainer`,
the configs in :mod:`trainer.config` and presets in :mod:`trainer.config.presets`. Submodules are imported
on use so that ``fastmoe-preprocess`` starts without torch or transformers.
"""

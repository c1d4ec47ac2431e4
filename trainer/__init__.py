"""trainer: pretraining of OLMoE / OLMo models with FastSparseMoE, sharded AdamW and EPSO.

Entry points: ``fastmoe-train --preset tiny-moe`` (trainer.cli), :class:`trainer.trainer.Trainer`,
the configs in :mod:`trainer.config` and presets in :mod:`trainer.config.presets`. Submodules are imported
on use so that ``fastmoe-preprocess`` starts without torch or transformers.

Layout, lowest layer first (tests/trainer/test_layers.py keeps imports pointing down): ``ft/`` fault
tolerance inside a worker (its launcher, ``ft/launch.py``, sits on top); ``config/`` the
configuration, config files and presets; ``layout.py`` the device mesh; ``records/`` what a run
records; ``data/``; ``model/`` the model, its families, loss and LoRA; ``optim/``;
``parallelism/``; ``checkpoint/``; ``outputs/`` what a run leaves (evaluation, export, samples);
``trainer.py`` the loop; ``cli.py`` its command line.
"""

"""Pipeline parallelism (``pipeline``), tensor parallelism (``tp``), selective activation
checkpointing (``ac``), model broadcast (``broadcast``) and the dry-run planner (``plan``): the parts
that :class:`trainer.trainer.Trainer` composes, each applied by a function (``parallelize_pipeline``,
``apply_tensor_parallel``, ``apply_activation_checkpointing``, ``broadcast_replicas``). Modules are
imported on demand so that the planner starts without torch. The rank layout is :mod:`trainer.layout`."""

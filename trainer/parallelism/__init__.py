"""Pipeline parallelism (``pipeline``), tensor parallelism (``tp``), selective activation
checkpointing (``ac``), model broadcast (``broadcast``), the dry-run planner (``plan``) and the
trainer that combines them (``trainer.ParallelTrainer``). Modules are imported on demand so that
the planner starts without torch."""

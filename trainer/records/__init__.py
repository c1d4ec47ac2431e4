"""What a run records while it trains: metrics and MFU (:mod:`.metrics`), TensorBoard and Weights &
Biases scalars (:mod:`.tb_writer`, :mod:`.wandb_writer`), the MoE routing health
(:mod:`.moe_health`), progress lines (:mod:`.progress`) and the startup summary (:mod:`.startup`)."""

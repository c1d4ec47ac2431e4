"""What a run leaves: held-out evaluation (:mod:`.evaluate`), the Hugging Face export
(:mod:`.export`, ``fastmoe-export``), text samples (:mod:`.generate`) and the end-of-run steps that
write them (:mod:`.run_end`)."""

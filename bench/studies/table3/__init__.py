"""Table 3 (``fastmoe-bench --table3``): :mod:`.table` measures the columns and prints them beside the
published rows; :mod:`.workers` times the trainer's own training steps behind the training columns."""

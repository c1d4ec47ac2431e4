"""Microbenchmarks of FastSparseMoE against the Hugging Face references: ``fastmoe-bench --help``."""

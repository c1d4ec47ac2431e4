"""Microbenchmarks of FastSparseMoE against the Hugging Face references: ``python -m bench --help``."""

"""The trainer's configuration error, in a leaf module so that every part of the trainer can raise it
without importing the config module (which imports some of them back for its checks)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the CLI prints its message as one line and exits non-zero."""

"""The device the suite runs its kernel and block tests on: ``--device`` or ``FASTMOE_TEST_DEVICE``.

Read from the command line before pytest parses it, because whether the Triton interpreter is on
must be decided before anything imports triton (tests/conftest.py does that at import). ``cpu``
(the default) keeps today's runs: Triton under the interpreter. ``cuda`` or ``xpu`` runs the
device-aware tests on that device with compiled kernels (``make gpu-check``).
"""
from __future__ import annotations

import os
import sys

DEVICES = ("cpu", "cuda", "xpu")


def test_device_name(argv: list[str] | None = None) -> str:
    """The requested device type; ValueError for an unknown one."""
    args = sys.argv if argv is None else argv
    name = os.environ.get("FASTMOE_TEST_DEVICE", "").strip().lower()
    for i, arg in enumerate(args):
        if arg == "--device" and i + 1 < len(args):
            name = args[i + 1].strip().lower()
        elif arg.startswith("--device="):
            name = arg.split("=", 1)[1].strip().lower()
    name = name or "cpu"
    if name not in DEVICES:
        raise ValueError(f"--device / FASTMOE_TEST_DEVICE must be one of {DEVICES}, got {name!r}")
    return name


# pytest would collect a module-level function named test_*; say it is not a test.
test_device_name.__test__ = False  # type: ignore[attr-defined]

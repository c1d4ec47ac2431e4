"""Triton's interpreter with numpy >= 2.4 (the CPU under ``TRITON_INTERPRET=1``).

Triton 3.6's interpreter (``triton/runtime/interpreter.py``, ``_patch_lang_tensor``) gives every
interpreted tensor ``__index__ = int(self.handle.data)``, and a scalar kernel argument is a
one-element array there. numpy 2.4 turned ``int()`` of a one-element array from a deprecation
warning into a TypeError, so ``range(0, n, BLOCK)`` over a runtime ``n`` (which several of our kernels
loop over) fails under the interpreter. Later Triton releases read ``int(self.handle.data.squeeze())``.

:func:`ensure_scalar_index` finds out by running a one-line kernel under the interpreter, and only
where it fails with that TypeError installs the later releases' ``__index__`` over the one Triton set
(a wrapper of ``_patch_lang_tensor``, so the interpreter's own set-up and tear-down stay as they are),
then runs the kernel again to prove it. Nothing changes where the kernel runs as it is (numpy < 2.4, a
Triton with the fix) or on a device, where nothing is interpreted. It runs once per process: the
launcher (:mod:`.launch`) calls it before the first kernel on CPU tensors, so every process that
interprets our kernels (a script, a test, each rank of a multi-process run) gets the same correction.
"""
from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_done = False
_note: str | None = None


def _probe() -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_over_runtime_bound(out_ptr, n, BLOCK: tl.constexpr):
        acc = 0
        for i in range(0, n, BLOCK):
            acc += 1
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    _loop_over_runtime_bound[(1,)](out, 5, BLOCK=2)
    if int(out.item()) != 3:
        raise AssertionError(f"interpreter probe: range(0, 5, 2) ran {int(out.item())} times, expected 3")


def _install() -> str | None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return None
    try:
        _probe()
        return None
    except Exception as err:  # InterpreterError wraps the TypeError as text
        if "only 0-dimensional arrays can be converted to Python scalars" not in str(err):
            raise
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:
        raise RuntimeError("error: triton's interpreter fails on int() of a one-element numpy array and has no "
                           "_patch_lang_tensor to correct: install numpy<2.4")

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interp._patch_lang_tensor = _patch_lang_tensor
    _probe()
    import numpy
    import triton

    return (f"triton {triton.__version__} interpreter with numpy {numpy.__version__}: __index__ of interpreted "
            "scalars reads the one-element array's item (fastmoe_xpu/kernels/triton/interpreter_compat.py)")


def ensure_scalar_index() -> str | None:
    """None when nothing was needed (or Triton is absent / not interpreting); else a line saying
    what was installed (the test report prints it in its header). Raises what the probe raised when
    the fix does not make it pass. The first call decides; later calls return the same."""
    global _done, _note
    if _done:
        return _note
    with _lock:
        if not _done:
            _note = _install()
            _done = True
    return _note

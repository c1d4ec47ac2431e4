"""Plant int32 row-index x stride products into real kernels and report what the offset check finds.

Run as a script (compiled mode: no ``TRITON_INTERPRET``) by ``test_compile_check.py``; prints one
JSON object ``{case: [findings]}``. Each case takes a kernel's source from its module, applies one
textual edit (none for the controls), writes it as a module of its own next to the imports the
kernels use, compiles it for sm_90 with the compile gate's spec of that kernel (its default config)
and runs :func:`fastmoe_xpu.tools.offset_check.int32_offset_products` on the TTIR.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import textwrap

os.environ.pop("TRITON_INTERPRET", None)
# A cache of its own: a cached compile's TTIR names the file of the compile that filled it (another
# run's deleted temporary file), so the findings' source lines could not be read.
_CACHE = tempfile.TemporaryDirectory(prefix="plant-int32-triton-cache-")
os.environ["TRITON_CACHE_DIR"] = _CACHE.name

from fastmoe_xpu.kernels.triton import counting, grouped_gemm  # noqa: E402
from fastmoe_xpu.tools.compile_check import compile_spec  # noqa: E402
from fastmoe_xpu.tools.kernel_specs import kernel_specs  # noqa: E402
from fastmoe_xpu.tools.offset_check import int32_offset_products  # noqa: E402

HEADER = """import triton
import triton.language as tl
from fastmoe_xpu.kernels.triton.common import *  # noqa: F401,F403
from fastmoe_xpu.kernels.triton.gemm_family import *  # noqa: F401,F403
"""

#: case -> (spec name, kernel, text to replace, replacement); None: the kernel unchanged (a control).
CASES = {
    # the down GEMM's rows: row_start (int32, loaded) times the row stride K
    "grouped_mm_fwd: row0 int32": ("grouped_mm_fwd[W^T]", grouped_gemm._grouped_mm_fwd_kernel,
                                   "row0 = row_start.to(tl.int64)", "row0 = row_start"),
    "grouped_mm_fwd: control": ("grouped_mm_fwd[W^T]", grouped_gemm._grouped_mm_fwd_kernel, None, None),
    # the gate/up forward's gathered token rows times H
    "gate_up_fwd: tok int32": ("gate_up_fwd", grouped_gemm._gate_up_fwd_kernel,
                               "other=0).to(tl.int64)", "other=0)"),
    "gate_up_fwd: control": ("gate_up_fwd", grouped_gemm._gate_up_fwd_kernel, None, None),
    # the token count's block start: a program id times a kernel argument
    "count_tokens: tok int32": ("count_tokens", counting._count_tokens_fwd_kernel,
                                "b.to(tl.int64) * block_size", "b * block_size"),
}


def planted(kernel, old: str | None, new: str | None, where: str, n: int):
    """``kernel``'s source with ``old`` replaced by ``new`` (exactly once), as a new jit function
    loaded from a file (Triton reads a kernel's source from its file)."""
    src = textwrap.dedent(inspect.getsource(kernel.fn))
    if old is not None:
        assert src.count(old) == 1, f"{old!r} occurs {src.count(old)} times in {kernel.fn.__name__}"
        src = src.replace(old, new)
    path = os.path.join(where, f"planted{n}_{kernel.fn.__name__.lstrip('_')}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(HEADER + "\n\n" + src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, kernel.fn.__name__)


def main() -> None:
    specs = {s.name: s for s in kernel_specs("cuda") if s.is_default}
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, (case, (name, kernel, old, new)) in enumerate(CASES.items()):
            spec = dataclasses.replace(specs[name], fn=planted(kernel, old, new, tmp, n))
            found[case] = int32_offset_products(compile_spec(spec, "cuda").asm["ttir"])
    print(json.dumps(found))


if __name__ == "__main__":
    main()

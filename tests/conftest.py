"""Suite-wide set-up: the Triton interpreter switch, and the ``interpreter`` / ``distributed`` / ``slow``
markers (registered in pyproject.toml) applied from what each test does.

The markers are derived here instead of written into the test files so that they follow a test
wherever its file moves and cover new tests without anyone remembering to add them. A test gets

- ``distributed`` when the code it runs (the test function, its fixtures, and the helper functions
  of the suite they call, followed transitively) calls one of the process launchers:
  ``run_distributed`` (``fastmoe_xpu.dist.testing``), ``run_workers`` (tests/parallel_util.py),
  ``spawn`` (tests/_ft_toy.py), the per-node launcher's ``run_node`` / ``run_local_nodes`` of the
  trainer's ``launch`` module, or starts ``python -m trainer.ft.launch`` in a subprocess;
- ``interpreter`` when its module holds the Triton launchers (a module under
  ``fastmoe_xpu.kernels.triton``) or its name says it runs them (``triton`` in the function name),
  except for the compile gates, which compile kernels for real targets instead;
- ``slow`` when it starts a fresh Python process through ``subprocess`` (a compile gate, a job run
  end to end, the node launcher): each one imports torch again and runs a whole program.

The ``drill`` marker (also registered in pyproject.toml) is written into tests/trainer/test_elastic_drills.py
itself: a drill is a named scenario, not something the hook can read from the code.

Select with ``-m``, e.g. ``pytest -m "not slow"`` or ``pytest -m "not (interpreter or distributed)"``.
The checkout and tests/ are put on ``sys.path`` by the ``pythonpath`` setting in pyproject.toml.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
import types
from pathlib import Path
from typing import Any, Iterator

import pytest

from device_util import test_device_name

#: ``--device`` / ``FASTMOE_TEST_DEVICE`` (tests/device_util.py): cpu unless a GPU run asks otherwise.
TEST_DEVICE = test_device_name()

# Triton kernels run on CPU tensors under Triton's interpreter, which triton fixes when it is first
# imported (torch._dynamo imports it while transformers loads): switch it on before any test module,
# unless the suite runs on a GPU, where the kernels are compiled.
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Blocks default to gemm_engine="auto", which times the engines on first use: the suite pins each
# backend's own stage 4 so that results do not depend on timing noise (tests/kernels/
# test_gemm_engines.py covers every engine and the chooser), and keeps any timed choice out of the
# user's cache directory.
os.environ.setdefault("FASTMOE_GEMM_ENGINE", "native")
os.environ.setdefault("FASTMOE_GEMM_CACHE", os.path.join(
    tempfile.mkdtemp(prefix="fastmoe-test-gemm-"), "gemm_engines.json"))

TESTS_DIR = Path(__file__).resolve().parent

# (last component of the defining module, qualified name) of every function that starts processes
_LAUNCHERS = {("testing", "run_distributed"), ("parallel_util", "run_workers"), ("_ft_toy", "spawn"),
              ("node", "run_node"), ("local_nodes", "run_local_nodes")}
# the node launcher started as a subprocess: a multi-process training run under fault tolerance
_LAUNCHER_MODULE = "trainer.ft.launch"
_TRITON_PACKAGE = "fastmoe_xpu.kernels.triton"
_SUBPROCESS_STARTS = {"run", "Popen", "call", "check_call", "check_output"}
_COMPILE_GATES = ("compile_check", "compile_xpu")


def _is_launcher(obj: Any) -> bool:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return False
    return (module.rsplit(".", 1)[-1], qualname) in _LAUNCHERS


def _in_suite(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS_DIR)


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    # nested functions, lambdas and comprehensions are constants of the enclosing code object
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


class _Reach:
    """What a piece of the suite's code ends up doing, followed through the suite's own helpers."""

    def __init__(self) -> None:
        self.launches = False
        self.subprocess = False
        self._seen: set[types.CodeType] = set()

    def visit(self, fn: Any) -> None:
        fn = getattr(fn, "__wrapped__", fn)
        code, glb = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or glb is None or code in self._seen:
            return
        self._seen.add(code)
        for co in _code_objects(code):
            self._seen.add(co)
            if _LAUNCHER_MODULE in co.co_consts:
                self.launches = self.subprocess = True
            modules = [v for n in co.co_names if isinstance(v := glb.get(n), types.ModuleType)]
            for name in co.co_names:
                # a global of the test's module, or an attribute of a module it references (toy.spawn);
                # read from the module's dict, since a module-level __getattr__ may import or warn
                candidates = [glb.get(name)] + [vars(m).get(name) for m in modules]
                for obj in candidates:
                    if obj is None:
                        continue
                    if getattr(obj, "__module__", None) == "subprocess" and name in _SUBPROCESS_STARTS:
                        self.subprocess = True
                    if _is_launcher(obj):
                        self.launches = True
                    elif isinstance(obj, types.FunctionType) and _in_suite(obj):
                        self.visit(obj)


def _module_holds(module: Any, predicate: Any, *, or_names_from: bool = False) -> bool:
    """Whether a test module imported a module whose name satisfies ``predicate`` (or, with
    ``or_names_from``, a function or class defined in one)."""
    for value in vars(module).values():
        if isinstance(value, types.ModuleType):
            name = value.__name__
        elif or_names_from and isinstance(value, (type, types.FunctionType)):
            name = getattr(value, "__module__", "") or ""
        else:
            continue
        if predicate(name):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        reach = _Reach()
        reach.visit(item.function)
        # pytest keeps the resolved fixtures of an item only on this attribute (no public accessor)
        fixture_info = getattr(item, "_fixtureinfo", None)
        for defs in (fixture_info.name2fixturedefs.values() if fixture_info is not None else ()):
            if defs and _in_suite(defs[-1].func):
                reach.visit(defs[-1].func)
        module = item.module
        compile_gate = _module_holds(module, lambda n: n.rsplit(".", 1)[-1] in _COMPILE_GATES, or_names_from=True)
        triton = _module_holds(module, lambda n: n.startswith(_TRITON_PACKAGE)) or "triton" in item.originalname
        if reach.launches:
            item.add_marker(pytest.mark.distributed)
        if triton and not compile_gate:
            item.add_marker(pytest.mark.interpreter)
        if reach.subprocess:
            item.add_marker(pytest.mark.slow)


_INTERPRETER_NOTE = pytest.StashKey["str | None"]()


def pytest_configure(config: pytest.Config) -> None:
    # Triton 3.6's interpreter against numpy >= 2.4 (fastmoe_xpu/kernels/triton/interpreter_compat.py, which
    # the launcher applies in every process, spawned ranks included); said in the header and summary. Imported
    # here, after TRITON_INTERPRET is set above, since the module's package imports triton.
    note = None
    if TEST_DEVICE == "cpu" and importlib.util.find_spec("triton") is not None:
        from fastmoe_xpu.kernels.triton.interpreter_compat import ensure_scalar_index

        note = ensure_scalar_index()
    config.stash[_INTERPRETER_NOTE] = note


def pytest_report_header(config: pytest.Config) -> str | None:
    return config.stash.get(_INTERPRETER_NOTE, None)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    # again at the end, where -q (which drops the header) still prints it
    note = config.stash.get(_INTERPRETER_NOTE, None)
    if note:
        terminalreporter.write_line(note)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", default=None, choices=("cpu", "cuda", "xpu"),
        help="device of the kernel and block tests (default cpu, Triton under the interpreter; also "
             "FASTMOE_TEST_DEVICE)",
    )


@pytest.fixture(scope="session")
def device() -> Any:
    """The torch device of the device-aware tests; skips (saying why) when it is not visible."""
    import torch

    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda: torch sees no CUDA device")
    if TEST_DEVICE == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        pytest.skip("--device xpu: torch sees no XPU device")
    return torch.device(TEST_DEVICE)


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """Names of the Triton kernels the code under test starts through ``kernels/triton/launch.launch``,
    in order. The trial launches of the config autotuner (on a GPU, the first launch at a new shape
    times every config of the kernel's list) are not counted: they are not the code's launches."""
    from fastmoe_xpu.kernels.triton import autotune, launch

    names: list[str] = []
    real_launch, real_select = launch.launch, autotune.select
    trials = [0]

    def spy(kernel, *args, **kwargs):
        if not trials[0]:
            names.append(getattr(kernel, "fn", kernel).__name__)
        return real_launch(kernel, *args, **kwargs)

    def select(*args, **kwargs):
        trials[0] += 1
        try:
            return real_select(*args, **kwargs)
        finally:
            trials[0] -= 1

    monkeypatch.setattr(launch, "launch", spy)
    monkeypatch.setattr(autotune, "select", select)
    return names

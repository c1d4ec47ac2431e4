"""The trainer's layers: every module imports only from its own layer or the ones below it.

Read from the source with ``ast`` (deferred imports inside functions count too), so that a shared
piece is moved down rather than imported back up. The order, lowest first, is :data:`LAYERS`; a
module belongs to the layer of the longest prefix that names it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "trainer"

#: Lowest first. Each layer may import from itself and from the layers before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    # fault tolerance inside a worker: signals, failure records, heartbeats, the watchdog, NaN checks,
    # the lease on an output directory; which output directories may be replaced; the configuration's
    # error (a leaf module of standard-library imports that every part raises)
    ("ft", "owned", "config.errors"),
    # the configuration: sections, files, presets, the transformers family's config, errors
    ("config",),
    # the device mesh and its small collectives
    ("layout",),
    # what a run records: metrics, TensorBoard, W&B, MoE health, progress lines, startup summary
    ("records",),
    ("data",),
    # the model, its families, loss and LoRA
    ("model",),
    ("optim",),
    ("parallelism",),
    ("checkpoint",),
    # what a run leaves: evaluation, export, samples, the end of a run
    ("outputs",),
    # the loop
    ("trainer",),
    # its command line
    ("cli", "__main__"),
    # command lines that drive the whole trainer: the node launcher, the fault benchmark and soak,
    # the per-rank memory and traffic measurement, the document mask's cost (two trainers in turn),
    # a layout at scale (the trace of the trainer's step, the step-time model, its validation runs)
    ("ft.launch", "ft.bench", "ft.async_bench", "ft.soak", "parallelism.measure", "data.mask_bench", "scale"),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (dotted, relative to the trainer package; '' is
    the package itself, below everything)."""
    best, best_len = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if module == "":
        return -1
    assert best >= 0, f"trainer.{module} is in no layer of LAYERS"
    return best


def imported_modules(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported trainer module relative to the package) for every import in ``path``."""
    is_pkg = path.name == "__init__.py"
    package = module.split(".") if module else []
    if not is_pkg:
        package = package[:-1]
    mods = _modules()
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] in ("trainer", "fastmoe_trainer"):
                target = node.module.partition(".")[2]
            else:
                continue
            # ``from . import fault``: the names may be modules themselves
            names = [f"{target}.{a.name}" if target else a.name for a in node.names]
            names = [n for n in names if n in mods] or [target]
        elif isinstance(node, ast.Import):
            names = [a.name.partition(".")[2] for a in node.names
                     if a.name.split(".")[0] in ("trainer", "fastmoe_trainer")]
        out += [(node.lineno, n) for n in names]
    return out


def test_every_module_has_a_layer():
    for module in _modules():
        layer_of(module)


def test_no_import_runs_up_the_layers():
    upward = []
    for module, path in _modules().items():
        mine = layer_of(module)
        for line, target in imported_modules(module, path):
            if layer_of(target) > mine:
                upward.append(f"trainer/{path.relative_to(ROOT)}:{line}: trainer.{module} "
                              f"({LAYERS[mine][0]}) imports trainer.{target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("module,target", [("model.loss", "trainer"), ("records.progress", "cli"),
                                           ("ft.stop", "checkpoint")])
def test_an_upward_import_is_seen(tmp_path, module, target):
    path = tmp_path / "m.py"
    depth = module.count(".")
    path.write_text(f"def f():\n    from {'.' * (depth + 1)}{target} import x\n")
    assert [t for _, t in imported_modules(module, path)] == [target]
    assert layer_of(target) > layer_of(module)

"""The import graph of the package, the trainer and the benchmark: the rules docs and README state.

Every ``.py`` file of ``fastmoe_xpu/``, ``trainer/`` and ``bench/`` is parsed (not imported) and
every import in it counts, at module level or inside a function, relative ones resolved against the
file's package, ``importlib.import_module("literal", ...)`` included. An import names the module it
loads, not the packages above it (``from a.b import c`` is an edge to ``a.b.c`` when that is a
module of the tree, else to ``a.b``): the rule is about files importing files.

These are the rules of the restructured tree (docs/architecture.md, no two files importing
each other): the tests are meant to pass from the restructuring on and are deliberately not
xfailed, so that a new circle fails the suite. The asserts print every offending edge with its
line, so a failure says where to cut without bisecting.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("fastmoe_xpu", "trainer", "bench")
TOOLS = "fastmoe_xpu.tools"


class Edge(NamedTuple):
    """One import: ``importer`` (a module of the tree) loads ``imported`` at ``line``."""

    importer: str
    imported: str
    line: int


def _module_name(path: Path) -> tuple[str, bool]:
    """Dotted name of a file of the tree, and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _tree_files() -> dict[str, tuple[Path, bool]]:
    modules = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name, is_package = _module_name(path)
            modules[name] = (path, is_package)
    return modules


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """Absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _import_module_target(call: ast.Call, module: str, is_package: bool) -> str | None:
    """``importlib.import_module("x")`` / ``import_module(".x", __name__)`` with a literal name."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called != "import_module" or not call.args:
        return None
    first = call.args[0]
    if not isinstance(first, ast.Constant) or not isinstance(first.value, str):
        return None
    name = first.value
    if not name.startswith("."):
        return name
    level = len(name) - len(name.lstrip("."))
    # anchored on __name__, the module itself is the package the name resolves in; on __package__,
    # the package that holds it
    anchor = call.args[1] if len(call.args) > 1 else None
    as_package = is_package or (isinstance(anchor, ast.Name) and anchor.id == "__name__")
    return _resolve(module, as_package, level, name.lstrip(".") or None)


def import_edges() -> list[Edge]:
    modules = _tree_files()
    known = set(modules)

    def in_tree(name: str) -> str | None:
        # the longest prefix of ``name`` that is a module of the tree (a.b.func -> a.b)
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            candidate = ".".join(parts[:n])
            if candidate in known:
                return candidate
        return None

    edges = []
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.append(sub if sub in known else base)
            elif isinstance(node, ast.Call):
                target = _import_module_target(node, module, is_package)
                targets = [target] if target else []
            for target in targets:
                resolved = in_tree(target) if target.split(".")[0] in ROOTS else None
                # outside packages (torch, transformers) and unknown names of our roots keep their
                # written name, so the direction rules still see them
                edges.append(Edge(module, resolved or target, node.lineno))
    return edges


def _graph(edges: list[Edge]) -> dict[str, set[str]]:
    known = set(_tree_files())
    graph: dict[str, set[str]] = {m: set() for m in known}
    for e in edges:
        if e.imported in known and e.imported != e.importer:
            graph[e.importer].add(e.imported)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _where(edges: list[Edge], a: str, b: str) -> str:
    lines = sorted({e.line for e in edges if e.importer == a and e.imported == b})
    return f"{a} -> {b} (line {', '.join(map(str, lines))})"


def test_the_walk_sees_the_whole_tree() -> None:
    modules = _tree_files()
    for root in ROOTS:
        assert root in modules, f"{root}/__init__.py not found under {REPO}"
    edges = import_edges()
    # relative imports resolve inside the tree: bench.cli imports bench.harness.cases
    assert ("bench.cli", "bench.harness.cases") in {(e.importer, e.imported) for e in edges}


def test_no_two_files_import_each_other() -> None:
    edges = import_edges()
    graph = _graph(edges)
    pairs = sorted({tuple(sorted((a, b))) for a, outs in graph.items() for b in outs if a in graph.get(b, ())})
    assert not pairs, "files that import each other (at any level, lazy imports included):\n" + "\n".join(
        f"  {_where(edges, a, b)}  and  {_where(edges, b, a)}" for a, b in pairs)


def test_no_import_cycle() -> None:
    edges = import_edges()
    graph = _graph(edges)
    cycles = _cycles(graph)
    report = []
    for component in cycles:
        members = set(component)
        report.append("  cycle among " + ", ".join(component) + ":")
        report += [f"    {_where(edges, a, b)}" for a in component for b in sorted(graph[a] & members)]
    assert not cycles, "import cycles between modules:\n" + "\n".join(report)


def test_the_package_never_imports_the_trainer_or_the_benchmark() -> None:
    bad = sorted({_where(import_edges(), e.importer, e.imported) for e in import_edges()
                  if e.importer.split(".")[0] == "fastmoe_xpu" and e.imported.split(".")[0] in ("trainer", "bench")})
    assert not bad, "fastmoe_xpu must not depend on trainer/ or bench/:\n  " + "\n  ".join(bad)


def test_only_the_tools_import_the_tools() -> None:
    edges = import_edges()

    def under_tools(name: str) -> bool:
        return name == TOOLS or name.startswith(TOOLS + ".")

    bad = sorted({_where(edges, e.importer, e.imported) for e in edges
                  if under_tools(e.imported) and not under_tools(e.importer)})
    assert not bad, f"{TOOLS} is not on the training path; nothing outside it (and tests/) may import it:\n  " + \
        "\n  ".join(bad)

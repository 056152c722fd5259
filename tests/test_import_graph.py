"""The import graph of our packages has no circles, and imports point down (bus -> actors -> storage).

Read from the source with `ast`: every import counts, at module level, inside a
function, or under `TYPE_CHECKING`, because a circle of type-only imports still
ties the modules together for the reader and for the next change that makes one
of them real. `graphlib` finds the circles.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bus", "actors", "storage")  # in import order: a package imports only those after it
# The sub-facades reach the Bus they belong to through a type-only import of bus.client, which
# imports them. A later change hands them a context object instead; until then these edges, and
# only these, are allowed to close a circle.
TYPE_ONLY_BUS_CLIENT = {
    "bus.admin",
    "bus.claims",
    "bus.consumer",
    "bus.eventstore",
    "bus.handoff",
    "bus.metrics",
    "bus.queue_features",
    "bus.queues",
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Line numbers of the statements inside `if TYPE_CHECKING:` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, type-only) for every import in the file, resolved to one of `modules` or kept as written."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        for target in targets:
            while "." in target and target not in modules:
                target = target.rpartition(".")[0]
            found.append((target, node.lineno, node.lineno in type_only))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """The import graph of our modules, and every import that points up or into benchmarks."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    wrong = []
    for name, path in modules.items():
        for target, line, type_only in _imports(name, path, modules):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target.split(".")[0] == "benchmarks":
                wrong.append(where)
            if target not in modules or target == name:
                continue
            if PACKAGES.index(target.split(".")[0]) < PACKAGES.index(name.split(".")[0]):
                wrong.append(where)
            if type_only and target == "bus.client" and name in TYPE_ONLY_BUS_CLIENT:
                continue
            graph[name].add(target)
    return graph, wrong


def test_the_import_graph_of_bus_actors_and_storage_has_no_circle() -> None:
    graph, _ = _graph()
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None


def test_imports_point_down_and_nothing_imports_benchmarks() -> None:
    _, wrong = _graph()
    assert wrong == []


def test_the_check_sees_a_circle_and_the_allowed_type_only_edges_are_real() -> None:
    graph, _ = _graph()
    # The allowed edges are really there (else the exception list is stale) and are the only ones dropped.
    modules = _modules()
    for name in TYPE_ONLY_BUS_CLIENT:
        assert ("bus.client", True) in {
            (t, type_only) for t, _, type_only in _imports(name, modules[name], modules)
        }
        assert "bus.client" not in graph[name]
    assert "bus.admin" in graph["bus.client"]
    graph["bus.client"].add("bus.cli")
    graph["bus.cli"].add("bus.client")
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError:
        pass
    else:
        raise AssertionError("a circle went unnoticed")

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
        for target, line, _type_only in _imports(name, path, modules):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target.split(".")[0] == "benchmarks":
                wrong.append(where)
            if target not in modules or target == name:
                continue
            if PACKAGES.index(target.split(".")[0]) < PACKAGES.index(name.split(".")[0]):
                wrong.append(where)
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


def test_the_check_sees_a_circle_and_no_sub_facade_imports_the_bus() -> None:
    graph, _ = _graph()
    # The sub-facades take a BusContext (bus.context), never the Bus: not even a type-only import.
    for name in ("bus.admin", "bus.claims", "bus.consumer", "bus.eventstore", "bus.handoff", "bus.queues"):
        assert "bus.client" not in graph[name] and "bus.context" in graph[name], name
    assert "bus.admin" in graph["bus.client"]
    graph["bus.client"].add("bus.cli")
    graph["bus.cli"].add("bus.client")
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError:
        pass
    else:
        raise AssertionError("a circle went unnoticed")


def test_import_bus_loads_names_not_the_driver_and_connect_loads_the_bus() -> None:
    import subprocess
    import sys

    code = (
        "import bus, sys\n"
        "heavy = {'asyncpg', 'asyncio', 'actors', 'bus.client', 'storage.db'}\n"
        "assert not heavy & set(sys.modules), sorted(heavy & set(sys.modules))\n"
        "assert issubclass(bus.TopicNotFoundError, bus.BusError) and bus.Config is not None\n"
        "connect = bus.connect\n"
        "assert {'asyncpg', 'bus.client'} <= set(sys.modules) and connect.__module__ == 'bus.client'\n"
        "from bus import Bus\n"
        "assert Bus.__module__ == 'bus.client'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_storage_imports_nothing_of_the_bus_or_the_actors() -> None:
    modules = _modules()
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for name, path in modules.items()
        if name.split(".")[0] == "storage"
        for target, line, _type_only in _imports(name, path, modules)
        if target.split(".")[0] in ("bus", "actors")
    ]
    assert wrong == []


# The modules that may import `bus.client`: the facade and the CLI, which build a Bus.
FACADE = {"bus", "bus.client", "bus.cli"}
# Integrations handed a user's Bus: they name its type for annotations only and never import it to run.
TAKE_A_BUS = {
    "bus.dashboard",
    "bus.dashboard.views",
    "bus.dashboard.web",
    "bus.workflows.dashboard",
    "bus.faststream.configs",
    "bus.faststream.testing",
    "bus.faststream.broker.broker",
    "bus.faststream.broker.router",
    "bus.faststream.publisher.producer",
    "bus.faststream.subscriber.usecase",
}


def test_only_the_facade_and_the_cli_import_the_bus_client() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name in FACADE:
            continue
        for target, line, type_only in _imports(name, path, modules):
            if target == "bus.client" and not (name in TAKE_A_BUS and type_only):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports bus.client")
    assert wrong == []
    # The check sees an import of the client where one is written.
    probe = ROOT / "bus" / "admin.py"
    assert all(target != "bus.client" for target, _, _ in _imports("bus.admin", probe, modules))
    assert any(
        target == "bus.client" for target, _, _ in _imports("bus.cli", ROOT / "bus" / "cli.py", modules)
    )


def _faststream_private_uses(source: str) -> list[str]:
    """What a module reaches of FastStream's private API: imports of `faststream._internal`, name-mangled attributes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("faststream._internal"):
            found.append(f"{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("faststream._internal")
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and "__" in node.attr.strip("_"):
            found.append(f"{node.lineno}: .{node.attr}")  # `_Class__name`: a class's private, mangled name
    return found


def test_only_the_compat_module_of_bus_faststream_uses_faststreams_private_api() -> None:
    package = ROOT / "bus" / "faststream"
    compat = package / "_compat.py"
    assert _faststream_private_uses(compat.read_text(encoding="utf-8")), "_compat.py no longer holds them"
    wrong = {
        str(path.relative_to(ROOT)): uses
        for path in sorted(package.rglob("*.py"))
        if path != compat and (uses := _faststream_private_uses(path.read_text(encoding="utf-8")))
    }
    assert wrong == {}
    # The check sees each kind of use.
    assert (
        len(
            _faststream_private_uses(
                "import faststream._internal.constants\n"
                "from faststream._internal.di import FastDependsConfig\n"
                "x = sub._SubscriberUsecase__build__middlewares_stack()\n"
            )
        )
        == 3
    )

"""The package's public names are written once: `bus.__all__` is what the imports and the lazy map say.

`bus/__init__.py` imports the light names (`X as X`, so type checkers see them
exported) and maps the others to their modules in `_LAZY`, loaded on first use;
type checkers read those from the `TYPE_CHECKING` imports, the one place a name
is written twice. Read from the source with `ast`, as a type checker reads it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bus

SOURCE = Path(bus.__file__)


def _imports(body: list[ast.stmt]) -> dict[str, tuple[str, str | None]]:
    """name -> (module, alias) of every `from module import name [as alias]` in `body`."""
    return {
        a.name: (node.module or "", a.asname)
        for node in body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bus.")
        for a in node.names
    }


def _parts() -> tuple[dict[str, tuple[str, str | None]], dict[str, tuple[str, str | None]], dict[str, str]]:
    """The module-level imports of ours, the `TYPE_CHECKING` imports and `_LAZY`, as written."""
    tree = ast.parse(SOURCE.read_text(encoding="utf-8"))
    eager = _imports(tree.body)
    type_checking = next(
        node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    lazy = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_LAZY"
    )
    return eager, _imports(type_checking.body), ast.literal_eval(lazy)


def test_the_type_checking_imports_are_the_lazy_map() -> None:
    _eager, type_only, lazy = _parts()
    assert {name: module for name, (module, _alias) in type_only.items()} == lazy
    assert [name for name, (_module, alias) in type_only.items() if alias != name] == []


def test_all_is_every_name_imported_and_every_lazy_name_once() -> None:
    eager, _type_only, lazy = _parts()
    assert [name for name, (_module, alias) in eager.items() if alias != name] == []
    assert len(bus.__all__) == len(set(bus.__all__))
    assert set(bus.__all__) == set(eager) | set(lazy)
    assert not set(eager) & set(lazy)
    for name in bus.__all__:
        value = getattr(bus, name)
        assert value.__name__ == name and value.__module__.split(".")[0] in ("bus", "storage"), name


def test_a_lazy_name_resolves_to_the_module_the_map_names() -> None:
    _eager, _type_only, lazy = _parts()
    for name, module in lazy.items():
        assert getattr(bus, name).__module__ == module, name

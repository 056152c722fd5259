"""The docs in docs/ stay true to the code: the tests they cite exist, the files they name exist,
and every configuration key is documented with its default and environment variable."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from bus.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("architecture.md", "guarantees.md", "operations.md")
# `tests/x/test_y.py::test_name`, `tests/x/test_y.py`, or a continuation `::test_name` after a file in the same cell.
_CITED = re.compile(r"`(tests/[\w/]+\.py)?(?:::(test_\w+))?`")
_PATH = re.compile(r"`((?:bus|actors|storage|tests|scripts)/[\w/.-]+\.(?:py|sql|sh))`")


def _text(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
    }


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_test_exists(doc: str) -> None:
    missing = []
    cited = 0
    for line in _text(doc).splitlines():
        current: str | None = None
        for match in _CITED.finditer(line):
            current = match.group(1) or current
            if match.group(2) is None:
                continue
            assert current is not None, f"{doc}: `::{match.group(2)}` without a file before it: {line[:80]}"
            cited += 1
            if match.group(2) not in _test_names(ROOT / current):
                missing.append(f"{current}::{match.group(2)}")
    assert missing == [], f"{doc} cites tests that do not exist: {missing}"
    if doc == "architecture.md":
        assert cited >= 30  # the invariant table really was read


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_source_file_exists(doc: str) -> None:
    named = set(_PATH.findall(_text(doc)))
    missing = sorted(p for p in named if "NNN" not in p and not (ROOT / p).exists())
    assert missing == [], f"{doc} names files that do not exist: {missing}"


def test_every_configuration_key_is_documented_with_its_default_and_variable() -> None:
    text = _text("operations.md")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    defaults = msgspec.structs.asdict(Config())
    for key, default in defaults.items():
        cell = f"`{key}` (`BUS_{key.upper()}`)"
        assert cell in rows, f"operations.md has no row for {cell}"
        shown = f'`"{default}"`' if isinstance(default, str) else str(default)  # 3.0, 1048576, None
        assert f"| {shown}" in rows[cell], f"operations.md: {key} default should read {shown}"


def test_every_migration_is_listed_in_the_architecture() -> None:
    text = _text("architecture.md")
    for sql in sorted((ROOT / "storage" / "migrations").glob("*.sql")):
        number, name = sql.stem.split("_", 1)
        assert f"| {number} `{name}` |" in text, f"docs/architecture.md does not list migration {sql.name}"


def _api_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_is_the_one_the_docstrings_give() -> None:
    written = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert written == _api_reference().render(), (
        "docs/api.md differs from the docstrings: run `python scripts/api_reference.py --write`"
    )


def test_every_public_name_of_the_reference_has_a_docstring() -> None:
    assert _api_reference().undocumented() == []

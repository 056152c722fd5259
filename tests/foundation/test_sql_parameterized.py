"""Invariant 8: only parameters reach SQL.

Every statement the bus runs is a constant string; values travel as $n
parameters. The only identifiers ever interpolated are the validated schema
name in storage/migrate.py (CREATE SCHEMA during migrations) and the digest
names of the routines of constant statements (storage/routines.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("storage", "bus", "actors")
SQL_METHODS = {
    "execute",
    "executemany",
    "fetch",
    "fetchrow",
    "fetchval",
    "fetchmany",
    "prepare",
    "cursor",
    "copy_records_to_table",
    "copy_to_table",
    "copy_from_query",
}
SQL_WORDS = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|CREATE|DROP|ALTER|WITH|SET|TRUNCATE|LOCK|LISTEN|NOTIFY)\b", re.I
)
# (file, snippet of the interpolated statement): the validated-schema identifier spots.
ALLOWED = {
    ("storage/migrate.py", 'CREATE SCHEMA IF NOT EXISTS "{schema}"'),
    ("storage/migrate.py", 'DROP SCHEMA IF EXISTS "{schema}" CASCADE'),  # validate_schema() just before
    # A routine's call: the digest name of a registered constant statement and $n placeholders.
    ("storage/routines.py", "SELECT * FROM {name}({', '.join(f'${i + 1}' for i in range(n))})"),
    # An earlier release's routine: the validated schema and a name matched against the digest pattern.
    ("storage/routines.py", "DROP FUNCTION IF EXISTS {search_path(schema)}.{name}"),
    # A routine's definition: the validated schema, the digest name, the server's type names and the
    # statement's quoted column names; its body is the constant statement.
    ("storage/routines.py", "CREATE FUNCTION {search_path(schema)}.{name_of(sql)}({args})"),
}


def _constant_built(node: ast.AST, constants: set[str]) -> bool:
    """Text made only of literals and module-level constants built the same way (no value can reach it)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _constant_built(node.left, constants) and _constant_built(node.right, constants)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        parts = [node.func.value, *node.args, *(k.value for k in node.keywords)]
        return all(_constant_built(p, constants) for p in parts)
    return False


def _module_constants(tree: ast.Module) -> set[str]:
    """Module-level names bound once to constant-built text, in order of definition."""
    constants: set[str] = set()
    bound: dict[str, int] = {}
    for stmt in tree.body:
        for target in stmt.targets if isinstance(stmt, ast.Assign) else []:
            if isinstance(target, ast.Name):
                bound[target.id] = bound.get(target.id, 0) + 1
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            if bound[name] == 1 and _constant_built(stmt.value, constants):
                constants.add(name)
    return constants


def _is_dynamic_string(node: ast.AST, constants: frozenset[str] | set[str] = frozenset()) -> bool:
    """An f-string, `%` formatting, `.format()`, or `+` concatenation involving a non-literal."""
    if _constant_built(node, set(constants)):
        return False
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.Add)):
        sides = (node.left, node.right)
        stringy = any(
            isinstance(s, (ast.Constant, ast.JoinedStr))
            and not isinstance(getattr(s, "value", ""), (int, float))
            for s in sides
        )
        literal = all(isinstance(s, ast.Constant) for s in sides)
        return stringy and not literal
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return isinstance(node.func.value, (ast.Constant, ast.JoinedStr, ast.Name))
    return False


def _text(node: ast.AST) -> str:
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values
        )
    return ast.unparse(node)


def _violations(source: str, rel: str) -> list[str]:
    tree = ast.parse(source, filename=rel)
    constants = _module_constants(tree)
    found: list[str] = []

    def flag(node: ast.AST, why: str) -> None:
        text = _text(node)
        if not any(rel == f and snippet in text for f, snippet in ALLOWED):
            found.append(f"{rel}:{node.lineno}: {why}: {text[:100]}")  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        # conn.execute(f"..."), pool.fetch("..." % x), conn.fetchval("...".format(x)), "..." + x
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SQL_METHODS
        ):
            if node.args and _is_dynamic_string(node.args[0], constants):
                flag(node.args[0], f"{node.func.attr}() with a built statement")
        # A statement built into a variable first: X = f"SELECT ... {value}"
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None
            and _is_dynamic_string(node.value, constants)
        ):
            text = _text(node.value)
            if SQL_WORDS.search(text.strip("'\"")) or SQL_WORDS.search(text.lstrip("f'\"")):
                flag(node.value, "SQL text built from values")
    return found


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_value_is_formatted_into_sql_outside_the_validated_schema_spots() -> None:
    sources = _sources()
    assert any(p.name == "db.py" for p in sources)  # the scan really looks at the code
    problems = [
        v for p in sources for v in _violations(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())
    ]
    assert problems == [], "build SQL only from constants and pass values as $n parameters:\n" + "\n".join(
        problems
    )


def test_the_checker_catches_formatted_statements() -> None:
    # The scanner itself must notice the usual ways of building SQL from values.
    cases = {
        "await conn.execute(f\"DELETE FROM topics WHERE name = '{name}'\")": True,
        'await conn.fetch("SELECT * FROM t WHERE a = %s" % value)': True,
        'await pool.fetchval("SELECT {}".format(value))': True,
        'await conn.execute("SELECT " + value)': True,
        'Q = f"SELECT * FROM t WHERE a = {value}"': True,
        'await conn.execute("SELECT * FROM t WHERE a = $1", value)': False,
        "await conn.execute(QUERY, value)": False,
        'log.info(f"published {n}")': False,
        # Text joined from literals and module constants carries no value...
        '_PART = "lk AS (SELECT 1 FROM t WHERE a = {x})"\nQ = "WITH" + _PART.format(x="$1")': False,
        # ...but a name bound to anything else, or bound twice, may.
        '_PART = input()\nQ = "WITH" + _PART': True,
        '_PART = "x"\n_PART = input()\nQ = "WITH" + _PART': True,
        'def f(v):\n    Q = "WITH" + v': True,
    }
    for line, bad in cases.items():
        assert bool(_violations(line + "\n", "storage/probe.py")) is bad, line
    # The allowed spots are allowed only in storage/migrate.py.
    spot = "await conn.execute(f'CREATE SCHEMA IF NOT EXISTS \"{schema}\"')\n"
    assert _violations(spot, "storage/migrate.py") == []
    assert _violations(spot, "storage/topics.py") != []

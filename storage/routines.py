"""Statements the server keeps planned for a transaction pooler: each a PL/pgSQL function of its text.

Through a pooler in transaction mode (PgBouncer before 1.21, or without
`max_prepared_statements`) a client cannot keep a prepared statement: the
next transaction may run on another server connection. Every statement is
then parsed and planned again at each call, which costs little for a short
statement and most of the time of a queue take (a statement of a few dozen
CTEs: about 6 ms planned each time against 1.9 ms prepared, for 100 jobs).

A PL/pgSQL function keeps the plans of its statements per server connection,
with the choice between a custom and a generic plan a prepared statement
makes. So each statement listed by the modules named here (`ROUTINES`) is installed as a
function whose body is `RETURN QUERY` of the statement's own text
(`$1`..`$n` are the function's parameters there), named by a digest of that
text: a release finds the functions of exactly its statements, two releases
running on one schema during a rolling upgrade each find their own, and a
statement whose text changes gets a new function, never a stale one. The
migrator installs the missing ones (`install`); a connection through a
transaction pooler then sends a short call with the same parameters instead
of the statement (`install` answers the call of each statement there). A role
that may not create functions in the schema installs none, and its
statements run as they are. Direct connections prepare the statement
itself, as always.
"""

from __future__ import annotations

import hashlib
import importlib
import re

import asyncpg

from storage.connections import search_path
from storage.logs import get_logger

log = get_logger(__name__)

_PREFIX = "bus_stmt_"
_QUOTE = "$bus_stmt$"
#: The modules whose `ROUTINES` (a tuple of statements) are installed. Imported when asked for, not
#: here: they import the storage layer this module is part of.
_MODULES = ("storage.queues",)


def registered() -> list[str]:
    """The statements installed as routines, in order."""
    found: list[str] = []
    for module in _MODULES:
        for sql in importlib.import_module(module).ROUTINES:
            if _QUOTE in sql:
                raise ValueError(f"a statement installed as a routine may not contain {_QUOTE}")
            if sql not in found:
                found.append(sql)
    return found


def name_of(sql: str) -> str:
    """The function name of `sql`: the prefix and a digest of its text (a plain identifier)."""
    return _PREFIX + hashlib.sha256(sql.encode()).hexdigest()[:32]


#: What a routine's name looks like (the prefix and a hex digest): nothing else is ever dropped.
_NAME = re.compile(r"bus_stmt_[0-9a-f]{32}")

FIND = """
SELECT p.proname, p.pronargs FROM pg_catalog.pg_proc p
JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = $1 AND p.proname = ANY($2::text[])
"""

TYPE_NAMES = (
    "SELECT pg_catalog.format_type(t, NULL) FROM unnest($1::oid[]) WITH ORDINALITY AS u(t, i) ORDER BY i"
)


def _ident(name: str) -> str:
    """A column name as a quoted identifier (a statement's columns may be named `offset` or `?column?`)."""
    return '"' + name.replace('"', '""') + '"'


async def _definition(conn: asyncpg.Connection, schema: str, sql: str) -> tuple[str, int]:
    """CREATE FUNCTION of `sql` in `schema` (its parameter and column types as the server infers
    them), and how many parameters it takes."""
    statement = await conn.prepare(sql)
    params = list(statement.get_parameters())
    columns = list(statement.get_attributes())
    types = await conn.fetchval(
        "SELECT array_agg(x) FROM (" + TYPE_NAMES + ") AS s(x)",
        [t.oid for t in params] + [c.type.oid for c in columns],
    )
    args = ", ".join(f"p{i + 1} {types[i]}" for i in range(len(params)))
    outs = ", ".join(f"{_ident(c.name)} {types[len(params) + i]}" for i, c in enumerate(columns))
    # Only the schema (validated by the caller), the digest name, the server's type names and the
    # statement's own column names are formatted in; the body is the registered text.
    definition = (
        f"CREATE FUNCTION {search_path(schema)}.{name_of(sql)}({args}) RETURNS TABLE ({outs})\n"
        f"LANGUAGE plpgsql AS {_QUOTE}\n#variable_conflict use_column\nBEGIN\n"
        f"RETURN QUERY {sql.strip().rstrip(';')};\nEND\n{_QUOTE}"
    )
    return definition, len(params)


async def install(conn: asyncpg.Connection, schema: str) -> dict[str, str]:
    """Create the functions of the listed statements missing from `schema`; the call of each one there.

    Run by the migrator in its transaction (its lock, its search_path). A function the role may
    not create is skipped, leaving that statement to run as it is (it gets no call).
    The answer is {statement: the call that runs it}.
    """
    wanted = {name_of(sql): sql for sql in registered()}
    arity = {r["proname"]: r["pronargs"] for r in await conn.fetch(FIND, schema, list(wanted))}
    made = 0
    for name, sql in wanted.items():
        if name in arity:
            continue
        try:
            async with conn.transaction():
                definition, arity[name] = await _definition(conn, schema, sql)
                await conn.execute(definition)
        except asyncpg.InsufficientPrivilegeError as exc:
            log.debug("routine_not_installed", schema=schema, routine=name, error=str(exc))
            arity.pop(name, None)
            continue
        except asyncpg.PostgresError as exc:
            # The statement runs as it is; a server that cannot make its function is worth a word.
            log.warning("routine_not_installed", schema=schema, routine=name, error=str(exc))
            arity.pop(name, None)
            continue
        made += 1
    if made:
        log.debug("routines_installed", schema=schema, count=made)
    # The digest name of one of the listed statements (not the server's text) and $n placeholders:
    # the values go as the statement's own parameters.
    return {
        wanted[name]: f"SELECT * FROM {name}({', '.join(f'${i + 1}' for i in range(n))})"
        for name, n in arity.items()
    }


OF_SCHEMA = """
SELECT p.proname FROM pg_catalog.pg_proc p
JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = $1 AND p.proname LIKE 'bus\\_stmt\\_%'
"""


async def drop_unlisted(conn: asyncpg.Connection, schema: str) -> list[str]:
    """Drop the routines of `schema` that no statement of this release has (earlier releases'): their names.

    For `bus migrate --finalize`, once every process runs this release. A process that still
    called one (a later release's, started already) runs its statement as it is from then on.
    """
    listed = {name_of(sql) for sql in registered()}
    dropped: list[str] = []
    for r in await conn.fetch(OF_SCHEMA, schema):
        name = r["proname"]
        if name in listed or not _NAME.fullmatch(name):
            continue
        # The schema is validated by the caller and the name matched against _NAME just above.
        await conn.execute(f"DROP FUNCTION IF EXISTS {search_path(schema)}.{name}")
        dropped.append(name)
    return dropped

"""PgBouncer in transaction mode in front of the test server (scripts/pgbouncer.sh), and Buses through it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

import bus

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pgbouncer.sh"


def _bouncer(dsn: str, mode: str) -> Iterator[str]:
    if shutil.which("pgbouncer") is None and not Path("/usr/sbin/pgbouncer").exists():
        message = "pgbouncer is not installed (scripts/ensure-pgbouncer.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    parts = urlsplit(dsn)
    assert parts.hostname and parts.port and parts.username, f"a TCP DSN with a user is needed: {dsn!r}"
    work = tempfile.mkdtemp(prefix=f"bus-pgbouncer-{mode}-")
    os.chmod(work, 0o755)
    env = {**os.environ, "PGB_PASSWORD": parts.password or ""}
    args = [str(SCRIPT), "start", work, parts.hostname, str(parts.port), parts.username, mode]
    port = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout.strip()
    netloc = (
        f"{parts.username}:{parts.password}@127.0.0.1:{port}"
        if parts.password
        else f"{parts.username}@127.0.0.1:{port}"
    )
    try:
        yield urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    finally:
        subprocess.run([str(SCRIPT), "stop", work], check=False)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def bouncer_dsn(dsn: str) -> Iterator[str]:
    """The test server's DSN through PgBouncer in transaction mode."""
    yield from _bouncer(dsn, "transaction")


@pytest.fixture(scope="session")
def session_bouncer_dsn(dsn: str) -> Iterator[str]:
    """The test server's DSN through PgBouncer in session mode."""
    yield from _bouncer(dsn, "session")


@pytest.fixture
async def pooled(
    bouncer_dsn: str, dsn: str, schema: str, drop_schema: None, fast: dict[str, Any]
) -> AsyncIterator[Any]:
    """Open Buses on the test's schema through the transaction pooler (`direct=True`: LISTEN goes direct)."""
    opened: list[bus.Bus] = []

    async def open_bus(direct: bool = False, **config: Any) -> bus.Bus:
        settings = {**fast, "schema": schema, "pooler": "transaction", **config}
        if direct:
            settings["direct_dsn"] = dsn
        b = await bus.connect(bouncer_dsn, **settings)
        opened.append(b)
        return b

    yield open_bus
    for b in reversed(opened):
        await b.close()


@pytest.fixture
async def connect(bouncer_dsn: str, schema: str, drop_schema: None) -> AsyncIterator[Any]:
    """The tests imported into tests/pooler open their Buses through the transaction pooler."""
    opened: list[bus.Bus] = []

    async def open_bus(**config: Any) -> bus.Bus:
        config.setdefault("schema", schema)
        config.setdefault("pooler", "transaction")
        b = await bus.connect(bouncer_dsn, **config)
        opened.append(b)
        return b

    yield open_bus
    for b in reversed(opened):
        await b.close()


@pytest.fixture(scope="module")
async def es_bus(bouncer_dsn: str, dsn: str) -> AsyncIterator[bus.Bus]:
    """The event store tests' shared Bus, through the transaction pooler."""
    import uuid

    import asyncpg

    schema = "t_es_" + uuid.uuid4().hex[:10]
    b = await bus.connect(bouncer_dsn, schema=schema, pooler="transaction")
    try:
        yield b
    finally:
        await b.close()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


@pytest.fixture
def store(es_bus: bus.Bus) -> Any:
    """An event store no other test uses (as tests/eventstore/conftest.py's)."""
    import uuid

    return es_bus.event_store("s-" + uuid.uuid4().hex[:12])


@pytest.fixture
async def group(store: Any) -> str:
    """A registered, active event store group."""
    await store.register_group("enrollment")
    return "enrollment"

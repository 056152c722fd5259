"""PgBouncer in transaction mode in front of the test server (scripts/pgbouncer.sh), and Buses through it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
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


@pytest.fixture(scope="session")
def bus_target(bouncer_dsn: str) -> tuple[str, dict[str, Any]]:
    """The tests collected here (and their imported modes) connect through the transaction pooler."""
    return bouncer_dsn, {"pooler": "transaction"}


@pytest.fixture
async def pooled(connect: Any, dsn: str, fast: dict[str, Any]) -> Any:
    """Open Buses through the transaction pooler (`direct=True`: LISTEN goes straight to the server)."""

    async def open_bus(direct: bool = False, **config: Any) -> bus.Bus:
        return await connect(**fast, **({"direct_dsn": dsn} if direct else {}), **config)  # type: ignore[no-any-return]

    return open_bus


# Fixtures of other directories for what runs here again: the compaction tests' Spark session, and the
# event store tests' fixtures (tests/eventstore/conftest.py) for the event store modes imported here.
from tests.compaction.conftest import spark  # noqa: E402, F401
from tests.eventstore.conftest import es_bus, group, store  # noqa: E402, F401

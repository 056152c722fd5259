"""The embedded default: no DSN and no $BUS_DSN means a PostgreSQL under $BUS_HOME, shared by every process.

Authentication and the lifecycle in detail: tests/embedded/.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

import bus
from bus.server import embedded
from tests.embedded.helpers import private_home, wait_until_stopped

# Servers of their own, started and stopped by processes: one at a time, with the cores to themselves.
pytestmark = pytest.mark.alone


async def test_connect_without_dsn_uses_the_embedded_server_under_bus_home(
    monkeypatch: pytest.MonkeyPatch, schema: str, drop_schema: None
) -> None:
    home = embedded.default_home()  # the suite's own embedded server (started if needed)
    monkeypatch.delenv("BUS_DSN", raising=False)
    monkeypatch.setenv("BUS_HOME", str(home))
    async with bus.connect(schema=schema) as b:
        server = b.embedded
        assert server is not None
        assert server.pgdata == home / "pgdata"
        assert (home / "pgdata" / "PG_VERSION").exists()
        # b.dsn is TCP on 127.0.0.1 (JDBC clients cannot use the unix socket), with the password if the
        # server has one (a server started by an older version, still running, has none).
        assert b.dsn.startswith("postgresql://") and f"@127.0.0.1:{server.port}/" in b.dsn
        conn = await asyncpg.connect(b.dsn)
        try:
            assert await conn.fetchval("SELECT inet_server_addr()::text") in ("127.0.0.1/32", "127.0.0.1")
        finally:
            await conn.close()
        # It also listens on its unix socket.
        assert server.socket_dir is not None
        assert (Path(server.socket_dir) / f".s.PGSQL.{server.port}").exists()
        conn = await asyncpg.connect(
            host=str(server.socket_dir), port=server.port, user="postgres", database="postgres"
        )
        try:
            assert await conn.fetchval("SELECT inet_server_addr()") is None  # a unix-socket session
        finally:
            await conn.close()
        await b.create_topic("t")
        assert (await b.publish("t", b"x")).offset == 0


async def test_a_running_embedded_server_is_reused() -> None:
    home = embedded.default_home()
    first = await asyncio.to_thread(embedded.ensure_server, home)
    again = await asyncio.to_thread(embedded.ensure_server, home)
    assert (again.port, again.pgdata) == (first.port, first.pgdata)


@pytest.fixture
def fresh_home() -> Iterator[Path]:
    """A BUS_HOME of its own; its server (a second one) is stopped at teardown."""
    with private_home() as home:
        yield home


_ENSURE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from bus.server.embedded import ensure_server

    server = ensure_server(Path(sys.argv[1]))
    print(server.port, server.dsn)
    """
)


@pytest.mark.slow
async def test_two_processes_starting_the_embedded_server_at_once_share_one(fresh_home: Path) -> None:
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _ENSURE,
            str(fresh_home),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 180)
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
    ports = {out.decode().split()[0] for out, _ in results}
    assert len(ports) == 1
    [port] = ports
    # Both DSNs carry the password and reach the one server.
    dsns = {out.decode().split()[1] for out, _ in results}
    assert len(dsns) == 1 and f"127.0.0.1:{port}/" in next(iter(dsns))
    # Both processes have exited: the server stopped after the last one.
    assert await asyncio.to_thread(wait_until_stopped, fresh_home)
    server = await asyncio.to_thread(embedded.ensure_server, fresh_home)  # started again on demand
    async with bus.connect(server.dsn, schema="fresh") as b:
        await b.create_topic("t")
        assert (await b.publish("t", b"x")).offset == 0
    assert await asyncio.to_thread(embedded.stop_server, fresh_home) is True
    assert await asyncio.to_thread(embedded.stop_server, fresh_home) is False

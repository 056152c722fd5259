"""StorageUnavailableError: an unreachable server gives a typed error that says what to check."""

from __future__ import annotations

import errno
import socket

import asyncpg
import pytest

import bus
from storage.availability import is_unavailable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connecting_to_a_closed_port_raises_storage_unavailable() -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres"
    with pytest.raises(bus.StorageUnavailableError, match="check the DSN and that the server runs"):
        await bus.connect(dsn)


async def test_bus_dsn_is_used_when_no_dsn_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _closed_port()
    monkeypatch.setenv("BUS_DSN", f"postgresql://postgres@127.0.0.1:{port}/postgres")
    with pytest.raises(bus.StorageUnavailableError, match=str(port)):
        await bus.connect()


async def test_storage_unavailable_is_a_bus_error() -> None:
    assert issubclass(bus.StorageUnavailableError, bus.BusError)


async def _refused() -> OSError:
    try:
        await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{_closed_port()}/postgres")
    except OSError as exc:
        return exc
    raise AssertionError("a closed port accepted a connection")


async def test_a_refused_connection_and_a_terminated_backend_are_outages(dsn: str) -> None:
    assert is_unavailable(await _refused())
    # asyncpg answers a terminated backend in several ways (which one depends on when it reads the
    # server's farewell): each is an outage.
    for _ in range(20):
        conn = await asyncpg.connect(dsn)
        try:
            other = await asyncpg.connect(dsn)
            await other.fetchval("SELECT pg_terminate_backend($1)", conn.get_server_pid())
            await other.close()
            with pytest.raises(Exception) as lost:
                await conn.fetchval("SELECT 1")
            assert is_unavailable(lost.value), repr(lost.value)
        finally:
            conn.terminate()


async def test_a_bug_raised_while_handling_an_outage_stays_a_bug() -> None:
    refused = await _refused()
    try:
        try:
            raise refused
        except OSError:
            {}["missing"]  # a bug in the code that handles the outage
    except KeyError as bug:
        assert bug.__context__ is refused
        assert not is_unavailable(bug)
    # the bus's own error raised while handling it stands for it
    try:
        try:
            raise refused
        except OSError:
            raise bus.BusError("could not publish")  # noqa: B904
    except bus.BusError as wrapped:
        assert is_unavailable(wrapped)


def test_oserrors_that_are_not_about_the_server_are_not_outages() -> None:
    assert not is_unavailable(PermissionError(errno.EACCES, "Permission denied"))
    assert not is_unavailable(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_unavailable(TimeoutError())
    assert is_unavailable(OSError("Multiple exceptions: [Errno 111] Connect call failed, [Errno 99] ..."))
    assert is_unavailable(OSError(errno.EHOSTUNREACH, "No route to host"))

"""StorageUnavailableError: an unreachable server gives a typed error that says what to check."""

from __future__ import annotations

import socket

import pytest

import bus


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

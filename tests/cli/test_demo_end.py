"""`bus demo` ends by saying where its data is and whether the embedded server is still up."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.demo import where_the_data_is
from bus.server.embedded import EmbeddedServer, ServerStatus

HOME = Path("/srv/app/.bus")
SERVER = EmbeddedServer(HOME / "pgdata", "127.0.0.1", 5555, HOME / "pgdata", password="s3cret-password")


def _status(**kw: object) -> ServerStatus:
    fields: dict[str, object] = dict(home=HOME, server=SERVER, keep=False, legacy=False, users=1)
    fields.update(kw)
    return ServerStatus(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (_status(), "server: stops as this command exits"),
        (
            _status(users=3),
            "server: still running for 2 other process(es); it stops after the last one exits",
        ),
        (
            _status(keep=True),
            "server: still running (started with `bus server start`); `bus server stop` stops it",
        ),
        (_status(legacy=True), "server: still running (started by an older version"),
    ],
)
def test_the_embedded_case_names_the_data_directory_and_the_servers_fate(
    status: ServerStatus, expected: str
) -> None:
    text = where_the_data_is(SERVER.dsn, "bus", SERVER, status)
    assert text.splitlines()[0] == f"data: schema 'bus' in the embedded PostgreSQL under {HOME / 'pgdata'}"
    assert expected in text and "s3cret-password" not in text


def test_an_external_database_is_named_with_its_password_masked() -> None:
    text = where_the_data_is("postgresql://app:hunter22@db.internal:5432/orders", "billing", None, None)
    assert "data: schema 'billing' in the database at postgresql://app:***@db.internal:5432/orders" in text
    assert "hunter22" not in text

"""Fixtures of the event store tests.

One Bus on one schema serves the whole area: every test gets a store of its
own (stores share nothing: positions, groups and cursors are all per store),
which saves a connect-and-migrate per test.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

import bus
from bus.eventstore import EventStore
from tests.helpers import bus_of_its_own


@pytest.fixture(scope="module")
async def es_bus(dsn: str, bus_target: tuple[str, dict[str, Any]]) -> AsyncIterator[bus.Bus]:
    """A Bus on a schema of its own, shared by one test module."""
    target, defaults = bus_target
    async with bus_of_its_own(dsn, "t_es_", target, **defaults) as (b, _schema):
        yield b


@pytest.fixture
def store(es_bus: bus.Bus) -> EventStore:
    """A store no other test uses."""
    return es_bus.event_store("s-" + uuid.uuid4().hex[:12])  # type: ignore[no-any-return]


@pytest.fixture
async def group(store: EventStore) -> str:
    """A registered, active group."""
    await store.register_group("enrollment")
    return "enrollment"

"""Fixtures of the event store tests: a store with a registered group on a fresh schema."""

from __future__ import annotations

import pytest

import bus
from bus.eventstore import EventStore


@pytest.fixture
def store(b: bus.Bus) -> EventStore:
    """The store "courses" on the test's schema."""
    return b.event_store("courses")  # type: ignore[no-any-return]


@pytest.fixture
async def group(store: EventStore) -> str:
    """A registered, active group."""
    await store.register_group("enrollment")
    return "enrollment"

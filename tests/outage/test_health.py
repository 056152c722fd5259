"""`Bus.health()` on a Bus whose database is there: healthy, and "failed" once a system actor gave up.

A bug (not an outage) still stops an actor after its supervisor's restart
limit; the Bus then says so, and what depends on the actor raises
`bus.errors.ActorStoppedError` saying what to do.
"""

from __future__ import annotations

from typing import Any

import pytest

import bus
from actors.notifier import Notifier
from bus.testing import eventually


async def test_a_bus_that_reaches_its_database_is_healthy(b: bus.Bus) -> None:
    health = b.health()
    assert health.ok and health.status == "healthy"
    assert health.database_available and health.unavailable_since is None
    assert health.outages == 0 and health.failed_actors == [] and health.problems == []


async def test_a_system_actor_that_fails_of_a_bug_gives_up_and_the_bus_says_failed(
    connect: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: Notifier, wake_all: bool) -> None:
        raise RuntimeError("a bug in the notifier")

    monkeypatch.setattr(Notifier, "_ensure_connected", broken)
    b = await connect()
    await b.create_topic("jobs", partitions=1, semantics="queue")
    # Five restarts within 30 s, then the supervisor gives up (backoff 0.1 s doubling: about 3 s).
    health = await eventually(lambda: (h := b.health()).status == "failed" and h, timeout=20)
    assert health.failed_actors == ["notifier"] and health.database_available
    assert any("close this Bus and connect again" in p for p in health.problems)
    with pytest.raises(bus.errors.ActorStoppedError, match=r"b\.health\(\) names what failed") as caught:
        async with b.queue_consumer("jobs"):
            pass
    assert isinstance(caught.value, bus.errors.BusError)
    await b.close()
    assert b.health().status == "failed"

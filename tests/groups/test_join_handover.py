"""A joining process takes over its partitions on the release NOTIFY, never by waiting for the poll."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import bus
from actors.notifier import Notifier
from bus.testing import eventually

NO_POLL = 30.0  # a poll fallback too slow to rescue a missed NOTIFY within the test


async def _owned(b: bus.Bus, group: str) -> dict[str, int]:
    rows = await b.pool.fetch(
        "SELECT owner, count(*) FROM offsets WHERE group_name = $1 AND owner IS NOT NULL "
        "AND lease_expires_at > clock_timestamp() GROUP BY owner",
        group,
    )
    return {r[0]: r[1] for r in rows}


async def test_a_joiner_still_starting_to_listen_takes_every_partition_on_its_release(
    connect: Any, fast: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The joining process LISTENs to the messages channel only once its first worker subscribes,
    # just as the previous owners release. Made slow here (a busy server), the LISTEN is still
    # starting when the releases are notified: every worker must look at its lease after the
    # LISTEN, or the NOTIFY is lost and the partition waits for the poll fallback.
    real_listen = Notifier._listen

    async def slow_listen(self: Notifier, channel: str) -> bool:
        await asyncio.sleep(0.5)
        return await real_listen(self, channel)

    monkeypatch.setattr(Notifier, "_listen", slow_listen)
    timings = {**fast, "max_poll_interval": NO_POLL}
    first, joiner = await connect(**timings), await connect(**timings)
    await first.create_topic("t", partitions=4)

    async def handler(m: bus.Message) -> None:
        return None

    async def slow_revoke(partitions: Any) -> None:
        await asyncio.sleep(0.2)  # the releases come after the joiner's workers first looked

    a = await first.subscribe("g", handler, topics=["t"], on_revoke=slow_revoke)

    async def held_by_one() -> bool:
        return sorted((await _owned(first, "g")).values()) == [4]

    await eventually(held_by_one)
    b = await joiner.subscribe("g", handler, topics=["t"])

    async def shared() -> bool:
        return sorted((await _owned(first, "g")).values()) == [2, 2]

    await eventually(shared, timeout=8.0)
    await b.stop()
    await a.stop()

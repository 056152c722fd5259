"""What an idle partition costs: its poll's lease check rides the worker's lent connection."""

from __future__ import annotations

import asyncio

from bus.testing import eventually
from storage import leases
from storage.db import Lender


async def test_an_idle_partitions_lease_check_uses_the_lent_connection_not_a_pool_acquire(
    connect, fast, monkeypatch
) -> None:
    # A pool acquire costs the pool's reset statement on release: for every idle partition at
    # every poll, a third of what an idle group sends the server.
    b = await connect(**fast)
    await b.create_topic("t", partitions=4)
    seen: list[object] = []
    real = leases.state

    async def recording(conn, group, partition_id, now=None):  # type: ignore[no-untyped-def]
        seen.append(conn)
        return await real(conn, group, partition_id, now)

    monkeypatch.setattr(leases, "state", recording)

    async def handler(m) -> None:  # type: ignore[no-untyped-def]
        return None

    sub = await b.subscribe("idle", handler, topics=["t"])
    # Nothing to read: each worker polls every max_poll_interval and checks its lease after the empty fetch.
    await eventually(lambda: len(seen) >= 8)
    await asyncio.sleep(fast["max_poll_interval"] * 2)
    assert seen and all(isinstance(conn, Lender) for conn in seen), {type(c).__name__ for c in seen}
    await sub.stop()

"""`retention=timedelta(0)`: a message goes as soon as every live group reading its partition committed past it."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import bus
from bus.testing import eventually
from tests.conftest import Connect
from tests.helpers import log_start


async def _stored(b: bus.Bus, topic: str) -> list[int]:
    return [
        int(r[0])
        for r in await b.pool.fetch(
            'SELECT m."offset" FROM messages m JOIN partitions p ON p.id = m.partition_id '
            "WHERE p.topic = $1 ORDER BY 1",
            topic,
        )
    ]


async def _poll_commit(c: object, count: int) -> list[bus.Message]:
    got: list[bus.Message] = []
    while len(got) < count:
        got += await c.poll(timeout=1.0, max_records=count - len(got))  # type: ignore[attr-defined]
    await c.commit()  # type: ignore[attr-defined]
    return got


async def test_retention_zero_is_accepted_and_reported(b: bus.Bus) -> None:
    info = await b.create_topic("t", retention=0)
    assert info.retention == timedelta(0)
    assert (await b.create_topic("t", retention=timedelta(0))).retention == timedelta(0)


async def test_retention_zero_removes_what_every_live_group_committed_past(connect: Connect) -> None:
    b = await connect(cleaner_interval=0.05)
    await b.create_topic("t", partitions=1, retention=timedelta(0))
    fast = b.consumer("fast", topics=["t"], auto_commit=False)
    slow = b.consumer("slow", topics=["t"], auto_commit=False)
    async with fast, slow:
        await b.publish_many("t", [b"%d" % i for i in range(10)])
        await _poll_commit(fast, 10)
        await _poll_commit(slow, 4)
        # The slowest live group holds the rest; what both passed goes at once.
        await eventually(lambda: _stored_is(b, list(range(4, 10))))
        await asyncio.sleep(0.2)  # more cleaner passes remove nothing more
        assert await _stored(b, "t") == list(range(4, 10))
        assert await log_start(b, "t") == 4
        await _poll_commit(slow, 6)
        await eventually(lambda: _stored_is(b, []))
        assert await log_start(b, "t") == 10
        # Readers are told where the log starts now.
        assert await b.read("t", offset=10) == []
        rec = await b.publish("t", b"next")
        assert rec.offset == 10
        assert [m.payload for m in await fast.poll(timeout=2.0)] == [b"next"]


async def _stored_is(b: bus.Bus, wanted: list[int]) -> bool:
    return await _stored(b, "t") == wanted


async def test_retention_zero_without_any_group_removes_at_once(connect: Connect) -> None:
    b = await connect(cleaner_interval=0.05)
    await b.create_topic("t", partitions=1, retention=0)
    await b.publish_many("t", [b"a", b"b"])
    await eventually(lambda: _stored_is(b, []))
    assert await log_start(b, "t") == 2

"""The poll consumer's flow control and offset lookups, named as aiokafka names them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import bus
from bus.errors import ValidationError
from tests.helpers import drain

T0 = bus.TopicPartition("orders", "0")
T1 = bus.TopicPartition("orders", "1")


async def _consumer(connect: Any, fast: dict[str, Any], **kw: Any) -> tuple[bus.Bus, bus.Consumer]:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=2)
    c = b.consumer("g", topics=["orders"], start="earliest", auto_commit=False, **kw)
    await c.start()
    await c.wait_assigned(10)
    return b, c


async def test_a_paused_partition_is_skipped_by_poll_and_resumes_where_it_stopped(
    connect: Any, fast: dict[str, Any]
) -> None:
    b, c = await _consumer(connect, fast)
    try:
        for p in ("0", "1"):
            await b.publish_many("orders", [bus.Outgoing({"i": i}, partition=p) for i in range(5)])
        first = await drain([c], 1, timeout=10.0)
        c.pause(T0)
        assert c.paused() == {T0}
        assert c.assignment() == {T0, T1}  # paused partitions stay assigned
        got = first + await drain([c], 10, timeout=1.5)
        from_0 = [m.offset for m in got if m.partition == "0"]
        # Nothing of partition 0 after the pause (what the first poll took before it is all it gives).
        assert [m.offset for m in got if m.partition == "1"] == list(range(5))
        before = len(from_0)
        await b.publish("orders", {"i": 5}, partition="0")
        assert [m for m in await c.poll(timeout=0.5) if m.partition == "0"] == []
        c.resume(T0)
        assert c.paused() == set()
        rest = await drain([c], 6 - before, timeout=10.0)
        assert from_0 + [m.offset for m in rest if m.partition == "0"] == list(range(6))
    finally:
        await c.close()


async def test_pause_of_a_partition_not_assigned_raises(connect: Any, fast: dict[str, Any]) -> None:
    _, c = await _consumer(connect, fast)
    try:
        with pytest.raises(ValidationError, match="not assigned"):
            c.pause(bus.TopicPartition("orders", "9"))
        with pytest.raises(ValidationError, match="not assigned"):
            await c.position(bus.TopicPartition("other", "0"))
        assert c.paused() == set()
    finally:
        await c.close()


async def test_position_committed_and_bounds_follow_polls_commits_and_seeks(
    connect: Any, fast: dict[str, Any]
) -> None:
    b, c = await _consumer(connect, fast, max_poll_records=3)
    try:
        await b.publish_many("orders", [bus.Outgoing({"i": i}, partition="0") for i in range(7)])
        assert await c.beginning_offsets([T0, T1]) == {T0: 0, T1: 0}
        assert await c.end_offsets([T0, T1]) == {T0: 7, T1: 0}
        assert await c.position(T1) == 0
        got = [m for m in await drain([c], 1, timeout=10.0) if m.partition == "0"]
        assert got and await c.position(T0) == got[-1].offset + 1
        assert await c.committed(T0) == 0  # the cursor starts at the log start; nothing committed yet
        await c.commit()
        assert await c.committed(T0) == got[-1].offset + 1
        await c.seek_to_end(T0)
        assert await c.position(T0) == 7
        assert await c.poll(timeout=0.3) == []
        await c.seek_to_beginning()  # every assigned partition
        assert await c.position(T0) == 0
        again = await drain([c], 7, timeout=10.0)
        assert [m.offset for m in again if m.partition == "0"] == list(range(7))
        assert await c.position(T0) == 7
        with pytest.raises(ValidationError, match="no such partition"):
            await c.end_offsets([bus.TopicPartition("orders", "5")])
    finally:
        await c.close()


async def test_offsets_for_times_finds_the_first_offset_at_or_after(
    connect: Any, fast: dict[str, Any]
) -> None:
    b, c = await _consumer(connect, fast)
    try:
        for i in range(3):
            await b.publish("orders", {"i": i}, partition="0")
        await asyncio.sleep(0.05)
        middle = datetime.now(UTC)
        await asyncio.sleep(0.05)
        for i in range(3, 5):
            await b.publish("orders", {"i": i}, partition="0")
        late = datetime.now(UTC) + timedelta(hours=1)
        found = await c.offsets_for_times({T0: middle, T1: middle})
        assert found == {T0: 3, T1: None}
        assert await c.offsets_for_times({T0: late}) == {T0: None}
        assert await c.offsets_for_times({T0: middle - timedelta(hours=1)}) == {T0: 0}
        with pytest.raises(ValidationError, match="timezone-aware"):
            await c.offsets_for_times({T0: datetime(2026, 1, 1)})  # noqa: DTZ001 - the naive value is the test
    finally:
        await c.close()

"""Consumer groups and the recorded start (invariant 6); fan-out to several groups."""

from __future__ import annotations

import bus
from bus.testing import eventually
from tests.helpers import drain


async def test_latest_group_that_joined_after_three_old_messages_shows_lag_zero(connect, fast) -> None:
    b = await connect(**{**fast, "new_lookback": 0.0001})
    await b.create_topic("t", partitions=1)
    for i in range(3):
        await b.publish("t", {"old": i})
    async with b.consumer("late", topics=["t"], start="latest") as c:
        await c.wait_assigned()
        d = await b.admin.describe_group("late")
        assert d.total_lag == 0 and d.subscription.start == "latest"
        await b.publish("t", {"new": 1})
        got = await drain([c], 1)
        assert [m.value(dict) for m in got] == [{"new": 1}]


async def test_latest_group_reads_a_partition_created_after_it_joined_from_its_first_message(
    connect, fast
) -> None:
    b = await connect(**{**fast, "new_lookback": 0.0001})
    await b.create_topic("devices", partitions=None)
    await b.publish("devices", b"old", partition="d1")
    async with b.consumer("g", topics=["devices"], start="latest") as c:
        await c.wait_assigned()
        # d2 appears after the group's start: all of it is new to the group.
        await b.publish("devices", b"first", partition="d2")
        await b.publish("devices", b"second", partition="d2")
        got = await drain([c], 2, timeout=20)
        assert [(m.partition, m.payload) for m in got] == [("d2", b"first"), ("d2", b"second")]


async def test_the_first_subscriber_wins_and_a_later_mode_changes_nothing(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"before")
    async with b.consumer("g", topics=["t"], start="earliest") as c:
        assert [m.payload for m in await drain([c], 1)] == [b"before"]
    await b.admin.reset_offsets("g", to="earliest")
    async with b.consumer("g", topics=["t"], start="latest") as c2:
        got = await drain([c2], 1)
        assert [m.payload for m in got] == [b"before"]
    assert (await b.admin.describe_group("g")).subscription.start == "earliest"


async def test_every_group_gets_every_message_of_a_pubsub_topic(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=3)
    recs = [await b.publish("t", {"i": i}) for i in range(30)]
    groups = [b.consumer(f"g{i}", topics=["t"]) for i in range(4)]
    for c in groups:
        await c.start()
    for c in groups:
        got = await drain([c], 30)
        assert {(m.partition, m.offset) for m in got} == {(r.partition, r.offset) for r in recs}
    rows = await b.pool.fetchval("SELECT count(*) FROM offsets")
    assert rows == 4 * 3  # a cursor per (group, partition), not a row per message
    for c in groups:
        await c.close()


async def test_close_with_cancel_marks_the_group_cancelled(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    c = await b.consumer("g", topics=["t"]).start()
    await c.wait_assigned()
    await c.close(cancel=True)
    await eventually(lambda: _status(b, "cancelled"))


async def _status(b: bus.Bus, status: str) -> bool:
    return (await b.admin.describe_group("g")).status == status

"""Subscription start, recorded once per group (invariant 6): seeds 000 and 003 as tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

import bus
from bus.start import parse_start
from tests.conftest import Connect


async def _age(b: bus.Bus, topic: str, minutes: float) -> None:
    """Pretend the topic's current messages were published `minutes` ago."""
    await b.pool.execute(
        "UPDATE messages SET created_at = created_at - make_interval(mins => $2) "
        "WHERE partition_id IN (SELECT id FROM partitions WHERE topic = $1)",
        topic,
        minutes,
    )


async def _pop(b: bus.Bus, group: str, topic: str = "t", **kw: object) -> list[bytes | None]:
    c = await b.claim(group, topic=topic, worker_id="w", **kw)  # type: ignore[arg-type]
    if c is None:
        return []
    await c.ack()
    return [m.payload for m in c.messages]


# -- seed 003's six scenarios -------------------------------------------------------


async def test_latest_on_an_empty_partition_gets_the_first_message_published_after(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"seed", partition="p0")  # the topic has a partition; p1 is still empty
    await _age(b, "t", 60)
    assert await _pop(b, "cg1", start="latest") == []
    await b.publish("t", b"M1", partition="p1")
    assert await _pop(b, "cg1", start="latest") == [b"M1"]


async def test_latest_skips_history_and_reads_what_comes_next(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish_many("t", [bus.Outgoing(x, partition="p1") for x in (b"M1", b"M2", b"M3")])
    await _age(b, "t", 5)
    assert await _pop(b, "cg1", start="latest") == []
    await b.publish("t", b"M4", partition="p1")
    assert await _pop(b, "cg1") == [b"M4"]


async def test_without_a_start_the_group_reads_from_the_beginning(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish_many("t", [bus.Outgoing(x, partition="p1") for x in (b"M1", b"M2")])
    await _age(b, "t", 5)
    assert await _pop(b, "cg-old", max_messages=10) == [b"M1", b"M2"]


async def test_default_start_latest_applies_to_groups_that_do_not_ask(connect: Connect) -> None:
    b = await connect(default_start="latest")
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"M1", partition="p1")
    await _age(b, "t", 5)
    assert await _pop(b, "cg-default") == []
    await b.publish("t", b"M2", partition="p1")
    assert await _pop(b, "cg-default") == [b"M2"]


async def test_latest_group_has_no_lag_for_history(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish_many("t", [bus.Outgoing(x, partition="p1") for x in (b"M1", b"M2", b"M3")])
    await _age(b, "t", 5)
    assert await _pop(b, "cg-metrics", start="latest") == []
    lag = await b.pool.fetchval(
        "SELECT p.log_end - o.committed FROM offsets o JOIN partitions p ON p.id = o.partition_id "
        "WHERE o.group_name = 'cg-metrics'"
    )
    assert lag == 0


async def test_mixed_groups_on_one_partition_are_independent(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"M1", partition="p1")
    await _age(b, "t", 5)
    assert await _pop(b, "cg-new", start="latest") == []
    assert await _pop(b, "cg-traditional", start="earliest") == [b"M1"]
    await b.publish("t", b"M2", partition="p1")
    assert await _pop(b, "cg-new") == [b"M2"]
    assert await _pop(b, "cg-traditional") == [b"M2"]


# -- seed 003's lookback: the message that triggered the consumer is not lost ---------


async def test_latest_keeps_the_triggering_message_within_the_lookback(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"trigger", partition="p1")
    assert b.config.lookback == 2 * b.config.max_poll_interval
    assert await _pop(b, "cg1", start="latest") == [b"trigger"]


# -- seed 000: the recorded start applies to what the group discovers later -----------


async def test_latest_group_reads_partition_created_after_it_joined(b: bus.Bus) -> None:
    """10:00 cg1 joins with 'latest'; 10:10 P2 appears with M1..M3; 10:15 cg1 first sees P2: gets all three."""
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"P1-old", partition="P1")
    await _age(b, "t", 30)
    assert await _pop(b, "cg1", start="latest") == []
    await b.pool.execute("UPDATE groups SET start_time = now() - interval '15 minutes' WHERE name = 'cg1'")
    await b.publish_many("t", [bus.Outgoing(x, partition="P2") for x in (b"M1", b"M2", b"M3")])
    await _age(b, "t", 5)  # P2's messages are from 10:10, long before "now - lookback"
    assert await _pop(b, "cg1", start="latest", max_messages=10) == [b"M1", b"M2", b"M3"]


async def test_latest_group_by_namespace_reads_topic_created_after_it_joined(connect: Connect) -> None:
    b = await connect()
    await b.create_topic("q1", partitions=None, namespace="ns1")
    await b.publish("q1", b"old", partition="p")
    await _age(b, "q1", 30)
    assert await b.claim("cg1", namespace="ns1", worker_id="w", start="latest") is None
    await b.pool.execute("UPDATE groups SET start_time = now() - interval '15 minutes' WHERE name = 'cg1'")
    await b.create_topic("q2", partitions=None, namespace="ns1")
    await b.publish("q2", b"M2", partition="p")
    await _age(b, "q2", 5)
    b2 = await connect()
    c = await b2.claim("cg1", namespace="ns1", worker_id="w")
    assert c is not None and (c.topic, [m.payload for m in c.messages]) == ("q2", [b"M2"])


async def test_first_subscriber_wins_and_a_later_mode_does_not_change_it(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"old", partition="p1")
    await _age(b, "t", 5)
    assert await _pop(b, "cg", start="latest") == []
    await b.publish("t", b"old2", partition="p2")
    await _age(b, "t", 5)
    assert await _pop(b, "cg", start="earliest") == []  # still latest: p2's history is skipped too
    assert await b.pool.fetchval("SELECT start_mode FROM groups WHERE name = 'cg'") == "latest"


async def test_default_start_is_not_re_evaluated_for_an_existing_group(connect: Connect) -> None:
    b1 = await connect(default_start="earliest")
    await b1.create_topic("t", partitions=None)
    await b1.publish("t", b"a", partition="p1")
    assert await _pop(b1, "cg") == [b"a"]
    await b1.close()
    b2 = await connect(default_start="latest")
    await b2.publish("t", b"b", partition="p2")
    await _age(b2, "t", 5)
    assert await _pop(b2, "cg") == [b"b"]  # still earliest
    assert await b2.pool.fetchval("SELECT start_mode FROM groups WHERE name = 'cg'") == "earliest"


async def test_datetime_start_reads_messages_created_at_or_after_it(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=None)
    await b.publish("t", b"two-hours", partition="p")
    await _age(b, "t", 60)
    await b.publish("t", b"one-hour", partition="p")
    await _age(b, "t", 60)
    await b.publish("t", b"now", partition="p")
    since = datetime.now(UTC) - timedelta(minutes=90)
    assert await _pop(b, "cg", start=since, max_messages=10) == [b"one-hour", b"now"]


async def test_explicit_offsets_start_there_and_other_partitions_at_the_log_start(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=2)
    await b.publish_many("t", [bus.Outgoing(b"%d" % i, partition="0") for i in range(4)])
    await b.publish("t", b"x", partition="1")
    got = set()
    start = {bus.TopicPartition("t", "0"): 2}
    for _ in range(3):
        c = await b.claim("cg", topic="t", worker_id="w", start=start, max_messages=10)
        if c is None:
            break
        got.add((c.partition, tuple(m.offset for m in c.messages)))
        await c.ack()
    assert got == {("0", (2, 3)), ("1", (0,))}


@pytest.mark.parametrize(
    "start", ["newest", 5, {("t",): 1}, {("t", "0"): -1}, {("bad topic", "0"): 1}, {}, ["earliest"]]
)
def test_bad_start_values_raise_validation_error(start: object) -> None:
    with pytest.raises(bus.ValidationError):
        parse_start(start, "earliest")


def test_naive_datetimes_are_local_time() -> None:
    naive = datetime(2024, 5, 1, 12, 0)
    spec = parse_start(naive, "earliest")
    assert spec.start_mode == "timestamp" and spec.start_time == naive.astimezone()

"""Prometheus metrics: counters move by what the bus did, lag equals describe_group's, nothing global."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import prometheus_client
import pytest
import structlog

import bus
import bus.metrics
from bus.testing import eventually
from tests.conftest import Connect
from tests.observability.helpers import value

Uniq = Callable[[str], str]


async def test_publish_counts_messages_and_observes_batch_sizes_per_topic(b: bus.Bus, uniq: Uniq) -> None:
    topic = uniq("orders")
    await b.create_topic(topic, partitions=2)
    for i in range(3):
        await b.publish(topic, {"i": i})
    await b.publish_many(topic, [bus.Outgoing(b"x", key=str(i)) for i in range(5)])
    await b.publish_many(topic, [])  # nothing appended: nothing counted
    assert value("bus_published_messages_total", topic=topic) == 8
    assert value("bus_publish_batch_size_count", topic=topic) == 4
    assert value("bus_publish_batch_size_sum", topic=topic) == 8
    assert value("bus_publish_batch_size_bucket", topic=topic, le="1.0") == 3
    assert value("bus_publish_batch_size_bucket", topic=topic, le="5.0") == 4


async def test_refused_publish_counts_nothing(b: bus.Bus, uniq: Uniq) -> None:
    topic = uniq("strict")
    await b.create_topic(topic, partitions=1, max_message_bytes=10)
    with pytest.raises(bus.ValidationError):
        await b.publish(topic, b"x" * 11)
    with pytest.raises(bus.ValidationError):
        await b.publish_many(topic, [b"ok", b"x" * 11])
    assert value("bus_published_messages_total", topic=topic) == 0


async def test_poll_consumer_counts_fetched_and_consumed_messages(
    connect: Connect, fast: dict[str, Any], uniq: Uniq
) -> None:
    b = await connect(**fast)
    topic, group = uniq("events"), uniq("readers")
    await b.create_topic(topic, partitions=3)
    await b.publish_many(topic, [bus.Outgoing({"n": i}, key=f"k{i}") for i in range(30)])
    async with b.consumer(group, topics=[topic]) as c:
        got: list[bus.Message] = []
        while len(got) < 30:
            got.extend(await c.poll(timeout=5.0))
    labels = {"group": group, "topic": topic}
    assert len(got) == 30
    assert value("bus_consumed_messages_total", **labels) == 30
    assert value("bus_fetched_messages_total", **labels) == 30
    assert value("bus_fetch_batch_size_sum", **labels) == 30
    assert 1 <= value("bus_fetch_batch_size_count", **labels) <= 30


async def test_handler_errors_and_dead_letters_are_counted(
    connect: Connect, fast: dict[str, Any], uniq: Uniq
) -> None:
    b = await connect(**fast)
    topic, group, dlq = uniq("jobs"), uniq("workers"), uniq("jobs.dlq")
    await b.create_topic(topic, partitions=1)
    await b.publish_many(topic, [{"n": i} for i in range(5)])
    handled: list[int] = []

    async def handler(m: bus.Message) -> None:
        if m.offset == 2:
            raise RuntimeError("poison")
        handled.append(m.offset)

    sub = await b.subscribe(
        group, handler, topics=[topic], retry=bus.Retry(max_attempts=3, backoff=0.01), dead_letter=dlq
    )
    try:
        await eventually(lambda: len(handled) == 4 and sub.dead_lettered == 1)
    finally:
        await sub.stop()
    labels = {"group": group, "topic": topic}
    assert value("bus_handler_errors_total", **labels) == 3  # every failed attempt
    assert value("bus_dead_lettered_messages_total", **labels) == 1
    assert value("bus_consumed_messages_total", **labels) == 4
    assert value("bus_published_messages_total", topic=dlq) == 1


async def test_rebalances_and_assignments_are_counted(
    connect: Connect, fast: dict[str, Any], uniq: Uniq
) -> None:
    b1 = await connect(**fast)
    b2 = await connect(**fast)
    topic, group = uniq("orders"), uniq("billing")
    await b1.create_topic(topic, partitions=4)
    c1 = b1.consumer(group, topics=[topic])
    await c1.start()
    await c1.wait_assigned()
    await eventually(lambda: len(c1.assignment()) == 4)
    c2 = b2.consumer(group, topics=[topic])
    await c2.start()
    try:
        await eventually(lambda: len(c1.assignment()) == 2 and len(c2.assignment()) == 2)
        await eventually(lambda: value("bus_partitions_revoked_total", group=group) == 2)
        # One process hosts the leader's Rebalancer: the first assignment moved 4, the second 2.
        assert value("bus_rebalances_total", group=group) >= 2
        assert value("bus_rebalance_moved_partitions_total", group=group) >= 6
        # Both members live in this process: what was assigned minus what was revoked is what they own.
        assert value("bus_partitions_assigned_total", group=group) == 6
    finally:
        await c2.close()
        await c1.close()
    assert value("bus_partitions_revoked_total", group=group) == 6


async def test_claims_acks_and_lost_leases_are_counted(b: bus.Bus, uniq: Uniq) -> None:
    topic, group = uniq("devices"), uniq("ingest")
    await b.create_topic(topic, partitions=None)
    await b.publish_many(topic, [bus.Outgoing(b"x", partition=f"d{i % 2}") for i in range(6)])
    first = await b.claim(group, topic=topic, worker_id="w-1", max_messages=10)
    second = await b.claim(group, topic=topic, worker_id="w-2", max_messages=2)
    assert first is not None and second is not None
    await first.ack()
    # w-2's lease runs out and w-3 takes the partition: w-2's ack is refused and counted.
    async with b.pool.acquire() as conn:
        await conn.execute("UPDATE offsets SET lease_expires_at = clock_timestamp() - interval '1 second'")
    third = await b.claim(group, topic=topic, worker_id="w-3", max_messages=10)
    assert third is not None and third.partition == second.partition
    with pytest.raises(bus.LeaseLostError):
        await second.ack()
    labels = {"group": group, "topic": topic}
    assert value("bus_claims_total", **labels) == 3
    assert value("bus_claimed_messages_total", **labels) == 3 + 2 + 3
    assert value("bus_claim_acks_total", **labels) == 1
    assert value("bus_lease_losses_total", **labels) == 1


async def test_queue_takes_acks_nacks_and_dead_letters_are_counted(b: bus.Bus, uniq: Uniq) -> None:
    topic = uniq("mail")
    await b.create_topic(topic, partitions=1, semantics="queue")
    await b.publish_many(topic, [b"a", b"b", b"c"])
    async with b.queue_consumer(topic, max_attempts=1) as q:
        jobs = await q.take(max_messages=3, timeout=1.0)
        assert len(jobs) == 3
        await q.ack(jobs[0])
        await q.ack_many([jobs[1]])
        await q.nack(jobs[2], error="boom")  # its last attempt: dead-lettered
    assert value("bus_queue_taken_messages_total", topic=topic) == 3
    assert value("bus_queue_acked_messages_total", topic=topic) == 2
    assert value("bus_dead_lettered_messages_total", group="", topic=topic) == 1


async def test_lag_gauges_equal_describe_group_after_an_update(b: bus.Bus, uniq: Uniq) -> None:
    topic, group = uniq("ledger"), uniq("audit")
    await b.create_topic(topic, partitions=2)
    await b.publish_many(topic, [bus.Outgoing({"n": i}, partition=str(i % 2)) for i in range(7)])
    c = await b.claim(group, topic=topic, worker_id="w", max_messages=2)
    assert c is not None
    await c.ack()
    # Before any update the gauges are absent: a scrape never queries the database.
    assert (
        bus.metrics.registry.get_sample_value(
            "bus_consumer_lag", {"group": group, "topic": topic, "partition": "0"}
        )
        is None
    )
    values = await b.metrics.update_lag(b)
    d = await b.admin.describe_group(group)
    assert {p.partition: p.lag for p in d.partitions} == {"0": 2, "1": 3}
    for p in d.partitions:
        labels = {"group": group, "topic": topic, "partition": p.partition}
        assert value("bus_consumer_lag", **labels) == p.lag
        assert values[(group, topic, p.partition)][0] == p.lag
        assert value("bus_consumer_lag_seconds", **labels) == pytest.approx(p.lag_seconds or 0.0, abs=5.0)
        assert value("bus_consumer_lag_seconds", **labels) > 0
    assert value("bus_lag_last_update_timestamp_seconds") > 0


async def test_lag_respects_a_latest_start_and_forgets_deleted_groups(connect: Connect, uniq: Uniq) -> None:
    b = await connect(new_lookback=0.0)  # no grace window: `latest` skips every older message
    topic, group = uniq("feed"), uniq("late")
    await b.create_topic(topic, partitions=1)
    await b.publish_many(topic, [b"old"] * 3)
    await b.claim(group, topic=topic, worker_id="w", start="latest", max_messages=1)
    await b.metrics.update_lag(b, groups=[group])
    labels = {"group": group, "topic": topic, "partition": "0"}
    assert value("bus_consumer_lag", **labels) == 0  # the start skipped the old messages
    await b.publish(topic, b"new")
    await b.metrics.update_lag(b)
    assert value("bus_consumer_lag", **labels) == 1
    await b.admin.delete_group(group)
    await b.metrics.update_lag(b)
    assert bus.metrics.registry.get_sample_value("bus_consumer_lag", labels) is None


async def test_lag_updater_actor_refreshes_the_gauges_periodically(b: bus.Bus, uniq: Uniq) -> None:
    topic, group = uniq("stream"), uniq("watch")
    await b.create_topic(topic, partitions=1)
    await b.claim(group, topic=topic, worker_id="w", max_messages=1)
    labels = {"group": group, "topic": topic, "partition": "0"}
    updater = bus.metrics.start_lag_updater(b, interval=0.05)
    try:
        await b.publish_many(topic, [b"x"] * 4)
        await eventually(lambda: value("bus_consumer_lag", **labels) == 4)
        await b.publish(topic, b"y")
        await eventually(lambda: value("bus_consumer_lag", **labels) == 5)
    finally:
        await updater.stop()


async def test_bad_metric_arguments_are_refused(b: bus.Bus) -> None:
    with pytest.raises(bus.ValidationError):
        await bus.metrics.update_lag(b, groups="one-string")
    with pytest.raises(bus.ValidationError):
        await bus.metrics.update_lag(b, groups=["bad name"])
    with pytest.raises(bus.ValidationError):
        bus.metrics.start_lag_updater(b, interval=0)
    with pytest.raises(bus.ValidationError):
        bus.metrics.start_http_server(-1)


async def test_the_text_exposition_and_the_http_endpoint_serve_the_bus_registry(
    b: bus.Bus, uniq: Uniq
) -> None:
    topic = uniq("exposed")
    await b.create_topic(topic)
    await b.publish(topic, b"x")
    text = bus.metrics.generate_latest().decode()
    assert f'bus_published_messages_total{{topic="{topic}"}} 1.0' in text
    server, thread = bus.metrics.start_http_server(0, addr="127.0.0.1")
    try:
        port = server.server_address[1]
        body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
        assert f'bus_published_messages_total{{topic="{topic}"}} 1.0' in body
        assert "python_gc_objects_collected_total" not in body  # only the bus's registry
    finally:
        server.shutdown()
        thread.join(5)


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def test_the_library_registers_nothing_in_the_default_registry_unless_asked() -> None:
    names = list(prometheus_client.REGISTRY._names_to_collectors)  # noqa: SLF001 - no public listing
    assert not [n for n in names if n.startswith("bus_")]
    own = prometheus_client.CollectorRegistry()
    bus.metrics.register(own)
    bus.metrics.register(own)  # idempotent
    bus.metrics.PUBLISHED.labels("registered-topic").inc(0)
    assert own.get_sample_value("bus_published_messages_total", {"topic": "registered-topic"}) == 0.0


_NO_PROMETHEUS = textwrap.dedent(
    """
    import asyncio, sys
    sys.modules["prometheus_client"] = None  # as if the metrics extra were not installed
    import bus, bus.metrics

    async def main():
        async with bus.connect(sys.argv[1], schema=sys.argv[2]) as b:
            await b.create_topic("t", partitions=1)
            await b.publish("t", b"x")
            await b.publish_many("t", [b"y"])
            c = await b.claim("g", topic="t", worker_id="w")
            await c.ack()
            assert await b.metrics.update_lag(b) == {("g", "t", "0"): (0, 0.0)}
        assert bus.metrics.ENABLED is False and bus.metrics.registry is None
        assert bus.metrics.generate_latest() == b""
        assert bus.metrics.value("bus_published_messages_total", topic="t") == 0.0
        try:
            bus.metrics.start_http_server(0)
        except bus.BusError as exc:
            assert "pgactorbus[metrics]" in str(exc)
        else:
            raise AssertionError("start_http_server without prometheus-client must raise")
        print("ok")

    asyncio.run(main())
    """
)


async def test_without_prometheus_client_every_metric_is_a_no_op(
    dsn: str, schema: str, drop_schema: None
) -> None:
    env = dict(os.environ)
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _NO_PROMETHEUS, dsn, schema],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


_WARM_UP = textwrap.dedent(
    """
    import asyncio, os, sys, threading

    imported_on = []

    def audit(event, args):
        if event == "import" and args[0] == "prometheus_client":
            imported_on.append(threading.current_thread() is threading.main_thread())

    sys.addaudithook(audit)
    import bus
    from actors import metrics

    async def main():
        async with bus.connect(os.environ["BUS_DSN"], schema=sys.argv[1]):
            for _ in range(400):  # no metric is used: the Bus's start alone makes them
                if metrics._registry is not None:
                    break
                await asyncio.sleep(0.05)
        print(metrics._registry is not None, imported_on[:1])

    asyncio.run(main())
    """
)


async def test_a_starting_bus_makes_its_metrics_in_a_thread_not_on_the_event_loop(
    dsn: str, schema: str, drop_schema: None
) -> None:
    # Importing prometheus-client and creating the metrics costs ~0.2 s of CPU: made on the event
    # loop at first use, it stalled a process's first partition assignment (a join waited for it).
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _WARM_UP, schema],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "BUS_DSN": dsn},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True [False]"  # made, and imported off the main thread


async def test_log_events_carry_group_member_generation_topic_and_partition(
    connect: Connect, fast: dict[str, Any], uniq: Uniq
) -> None:
    b = await connect(**fast)
    topic, group = uniq("logged"), uniq("tracers")
    await b.create_topic(topic, partitions=2)
    await b.publish_many(topic, [bus.Outgoing(b"x", partition=str(i % 2)) for i in range(4)])
    with structlog.testing.capture_logs() as events:
        async with b.consumer(group, topics=[topic]) as c:
            got: list[bus.Message] = []
            while len(got) < 4:
                got.extend(await c.poll(timeout=5.0))
    by_name: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("group") == group:
            by_name.setdefault(e["event"], []).append(e)
    for name in ("partition_acquired", "partition_released"):
        assert by_name.get(name), f"no {name} event among {sorted(by_name)}"
        for e in by_name[name]:
            assert {"group", "member", "generation", "topic", "partition"} <= set(e), e
            assert e["topic"] == topic and e["member"] == c.member_id
    for e in by_name["assignment"]:
        assert {"group", "member", "generation"} <= set(e)
    for e in by_name["rebalanced"]:
        assert {"group", "generation"} <= set(e)
    assert by_name["member_joined"] and by_name["member_left"]

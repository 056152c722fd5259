"""Shared set-up for the dashboard tests: a bus with something on every page."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import bus

TOKEN = "s3cret-admin-token"


class Enrolled(bus.Event, tag="dash.enrolled"):
    course: str


async def dead_letter_one(
    b: bus.Bus, queue: str, payload: Any, error: str = "boom: card declined", attempts: int = 1
) -> None:
    """Publish one job to `queue` and fail it `attempts` times, so it lands in `<queue>.dlq`."""
    await b.create_topic(queue, partitions=1, semantics="queue")
    await b.publish(queue, payload, key="k1")
    async with b.queue_consumer(queue, max_attempts=attempts, visibility_timeout=30.0) as q:
        for attempt in range(1, attempts + 1):
            jobs = await q.take(max_messages=1, timeout=5.0)
            assert len(jobs) == 1
            reason = error if attempt == attempts else "upstream 503"
            await q.nack(jobs[0], error=reason)


async def populate(b: bus.Bus) -> None:
    """Topics, a consumed group, a dead letter, a claims group and an event-store group."""
    await b.create_topic("orders", partitions=3, retention=timedelta(days=7), namespace="shop")
    await b.create_topic("customers", partitions=2, cleanup="compact", namespace="shop")
    await b.publish("customers", {"name": "Ada"}, key="c1")
    for i in range(30):
        await b.publish("orders", {"id": i}, key=f"c{i % 5}")
    async with b.consumer("email", topics=["orders"], max_poll_records=10) as c:
        got = 0
        while got < 10:
            got += len(await c.poll(timeout=1.0))
        await c.commit()
    await dead_letter_one(b, "jobs", {"job": 1}, attempts=3)
    claim = await b.claim("billing", topic="orders", worker_id="w-1", max_messages=5)
    assert claim is not None
    await claim.ack()
    store = b.event_store("courses")
    await store.append([Enrolled(course="algebra"), Enrolled(course="poetry")])
    await store.register_group("mailer")
    await store.register_group("certificates", max_attempts=1)
    c = await store.claim_next(
        "certificates", partition_by="course", handled_types=[Enrolled], worker_id="w-1"
    )
    assert c is not None
    await store.nack("certificates", c.offset_id, "KeyError: 'template'", worker_id="w-1")

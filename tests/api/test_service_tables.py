"""The service's own tables: reachable from the connections the bus hands out, never created in the bus schema."""

from __future__ import annotations

import uuid

import bus


async def test_b_connection_sees_the_service_tables_and_creates_outside_the_bus_schema(b: bus.Bus) -> None:
    table = f"payments_{uuid.uuid4().hex[:10]}"
    await b.create_topic("receipts")
    try:
        async with b.connection() as conn:
            await conn.execute(f"CREATE TABLE {table} (id int)")  # unqualified, as a service writes it
            async with conn.transaction():
                await conn.execute(f"INSERT INTO {table} VALUES (1)")
                await b.publish("receipts", {"id": 1}, connection=conn)  # the outbox on it
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 1
            where = await conn.fetchval("SELECT current_schema()")
        assert where != b.config.schema
        found = await b.pool.fetchval(
            "SELECT table_schema FROM information_schema.tables WHERE table_name = $1", table
        )
        assert found == where  # the service's schema, not the bus's
        assert len(await b.read("receipts")) == 1
        # The bus's own pool stays on the bus schema (its tables unqualified), as documented.
        assert await b.pool.fetchval("SELECT current_schema()") == b.config.schema
    finally:
        await b.pool.execute(f"DROP TABLE IF EXISTS public.{table}")


async def test_the_bus_documents_its_pool_and_dsn() -> None:
    doc = bus.Bus.__doc__ or ""
    assert "`pool`" in doc and "`dsn`" in doc and "search_path" in doc and "b.connection()" in doc

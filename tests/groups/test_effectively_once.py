"""Invariant 5: effectively-once when the handler's writes and the offset commit share a transaction."""

from __future__ import annotations

import asyncpg

from tests.helpers import drain


async def test_handler_writes_and_offset_commit_apply_or_roll_back_together(connect, fast, dsn) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    for i in range(5):
        await b.publish("t", {"i": i})
    app = await asyncpg.connect(dsn)  # the service's own connection, default search_path
    await app.execute("CREATE TEMP TABLE totals (i int)")
    try:
        async with b.consumer("g", topics=["t"], auto_commit=False) as c:
            batch = await drain([c], 5)
            # A failed unit of work: neither the rows nor the offsets stay.
            try:
                async with app.transaction():
                    await app.executemany(
                        "INSERT INTO totals VALUES ($1)", [(m.value(dict)["i"],) for m in batch]
                    )
                    await c.commit(connection=app)
                    raise RuntimeError("crash before commit")
            except RuntimeError:
                pass
            assert await app.fetchval("SELECT count(*) FROM totals") == 0
            assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name='g'") == 0
            # The retried unit of work applies both at once.
            async with app.transaction():
                await app.executemany(
                    "INSERT INTO totals VALUES ($1)", [(m.value(dict)["i"],) for m in batch]
                )
                await c.commit(connection=app)
            assert await app.fetchval("SELECT count(*) FROM totals") == 5
            assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name='g'") == 5
            # The caller's search_path is untouched.
            assert await app.fetchval("SHOW search_path") == '"$user", public'
    finally:
        await app.close()

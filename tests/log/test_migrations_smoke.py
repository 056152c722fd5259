import bus


async def test_group_schema_present(b: bus.Bus) -> None:
    rows = await b.pool.fetch("SELECT version FROM bus_migrations ORDER BY version")
    assert [r[0] for r in rows][:2] == [1, 2]
    await b.pool.fetchval("SELECT count(*) FROM partition_watermarks")

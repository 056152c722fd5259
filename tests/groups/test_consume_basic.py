from tests.helpers import drain


async def test_single_consumer_reads_everything_in_partition_order(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=4)
    for i in range(40):
        await b.publish("orders", {"i": i}, key=f"k{i % 7}")
    async with b.consumer("g1", topics=["orders"]) as c:
        got = await drain([c], 40)
        assert len(got) == 40
        by_part = {}
        for m in got:
            by_part.setdefault(m.partition, []).append(m.offset)
        for offs in by_part.values():
            assert offs == sorted(offs) == list(range(len(offs)))
        await c.commit()
    d = await b.pool.fetch("SELECT committed FROM offsets WHERE group_name='g1' ORDER BY partition_id")
    assert sum(r[0] for r in d) == 40


async def test_auto_commit_is_soft_and_an_explicit_commit_waits_for_the_flush(
    connect, fast, monkeypatch
) -> None:
    from storage import leases

    b = await connect(**fast)
    await b.create_topic("orders", partitions=2)
    for i in range(10):
        await b.publish("orders", {"i": i}, partition=str(i % 2))
    durable: list[bool] = []
    real = leases.commit_all

    async def recording(conn, group, member_id, entries, *, durable_commit=True, now=None):  # type: ignore[no-untyped-def]
        durable.append(durable_commit)
        return await real(conn, group, member_id, entries, durable=durable_commit, now=now)

    def wrapper(conn, group, member_id, entries, *, durable=True, now=None):  # type: ignore[no-untyped-def]
        return recording(conn, group, member_id, entries, durable_commit=durable, now=now)

    monkeypatch.setattr(leases, "commit_all", wrapper)
    async with b.consumer("g1", topics=["orders"]) as c:
        got = await drain([c], 10)
        assert len(got) == 10
        await c.poll(timeout=0.2)  # auto-commit of what the polls returned
        assert durable and not any(durable), durable
        assert await b.pool.fetchval("SELECT sum(committed) FROM offsets WHERE group_name='g1'") == 10
    async with b.consumer("g2", topics=["orders"], auto_commit=False) as c:
        assert len(await drain([c], 10)) == 10
        durable.clear()
        await c.commit()
        assert durable == [True]
    # The soft statement is the durable one with synchronous_commit off for its own transaction only.
    assert "set_config('synchronous_commit', 'off', true)" in leases.COMMIT_ALL_SOFT
    assert leases.COMMIT_ALL_SOFT.replace(", set_config('synchronous_commit', 'off', true) AS soft", "") == (
        leases.COMMIT_ALL_FENCED
    )

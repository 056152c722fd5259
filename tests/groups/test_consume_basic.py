import asyncio

import bus


async def drain(c, n, timeout=10.0):
    got = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(got) < n and asyncio.get_running_loop().time() < deadline:
        got.extend(await c.poll(timeout=0.5))
    return got


async def test_single_consumer_reads_everything_in_partition_order(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("orders", partitions=4)
    for i in range(40):
        await b.publish("orders", {"i": i}, key=f"k{i % 7}")
    async with b.consumer("g1", topics=["orders"]) as c:
        got = await drain(c, 40)
        assert len(got) == 40
        by_part = {}
        for m in got:
            by_part.setdefault(m.partition, []).append(m.offset)
        for offs in by_part.values():
            assert offs == sorted(offs) == list(range(len(offs)))
        await c.commit()
    d = await b.pool.fetch("SELECT committed FROM offsets WHERE group_name='g1' ORDER BY partition_id")
    assert sum(r[0] for r in d) == 40

"""Manual commits inside on_revoke (auto_commit=False): Kafka's commit-before-handover pattern."""

from __future__ import annotations

from typing import Any

import pytest

import bus
from bus.testing import eventually
from tests.helpers import drain


async def _committed(b: bus.Bus) -> dict[str, int]:
    rows = await b.pool.fetch(
        "SELECT p.name, o.committed FROM offsets o JOIN partitions p ON p.id = o.partition_id WHERE o.group_name='g'"
    )
    return {r["name"]: r["committed"] for r in rows}


async def test_an_earlier_uncommitted_revoke_is_reported_once_then_commit_in_on_revoke_applies(
    connect, fast
) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=3)
    for i in range(30):
        await b.publish("t", {"i": i}, partition=str(i % 3))
    calls: list[set[bus.TopicPartition]] = []
    errors: list[BaseException] = []
    a: Any = None

    async def on_revoke(tps: set[bus.TopicPartition]) -> None:
        calls.append(tps)
        if len(calls) == 1:
            return  # the first handover is left uncommitted: its new owner reads it again
        try:
            await a.commit()
        except bus.StaleGenerationError as exc:
            # The first handover's polled positions were never committed: reported once, nothing applied.
            errors.append(exc)
            await a.commit()

    a = b.consumer("g", topics=["t"], auto_commit=False, assignor="sticky", on_revoke=on_revoke)
    await a.start()
    await eventually(lambda: len(a.assignment()) == 3)
    assert len(await drain([a], 30)) == 30
    c2 = await b.consumer("g", topics=["t"], assignor="sticky").start()
    await eventually(lambda: len(calls) == 1 and len(a.assignment()) == 2)
    c3 = await b.consumer("g", topics=["t"], assignor="sticky").start()
    await eventually(lambda: len(calls) == 2 and len(a.assignment()) == 1)
    # The second on_revoke's first commit reported the first handover (never silently left out);
    # its retry applied: the partition it hands over, and the one `a` keeps, are committed through
    # everything polled.
    first, second = calls
    assert len(errors) == 1
    assert all(f"partition='{tp.partition}'" in str(errors[0]) for tp in first)
    kept = a.assignment()
    committed = await _committed(b)
    for tp in second | kept:
        assert committed[tp.partition] == 10
    for tp in first:
        assert committed[tp.partition] in (0, 10)  # 10 once its new owner committed its re-read
    await a.close()
    await c2.close()
    await c3.close()


async def test_commit_after_an_unannounced_move_still_reports_it_once(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=2)
    for i in range(20):
        await b.publish("t", {"i": i}, partition=str(i % 2))
    a = await b.consumer("g", topics=["t"], auto_commit=False, assignor="sticky").start()
    await eventually(lambda: len(a.assignment()) == 2)
    assert len(await drain([a], 20)) == 20
    c2 = await b.consumer("g", topics=["t"], auto_commit=False, assignor="sticky").start()
    await eventually(lambda: len(a.assignment()) == 1 and len(c2.assignment()) == 1)
    await eventually(
        lambda: b.pool.fetchval(
            "SELECT count(*) FROM offsets WHERE group_name='g' AND owner=$1", c2.member_id
        )
    )
    # No on_revoke: the next commit is what reports the move (nothing applied) ...
    with pytest.raises(bus.StaleGenerationError):
        await a.commit()
    # ... once: the partition `a` still owns commits on the next try.
    await a.commit()
    kept = a.assignment().pop()
    assert (await _committed(b))[kept.partition] == 10
    await a.close()
    await c2.close()

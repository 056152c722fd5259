"""What an idle group costs: the poll fallback is one statement per process per interval, not per partition."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

import bus
from bus.testing import eventually
from storage import leases


class StatementCounter:
    """Every statement any asyncpg connection of this process sends, while `counting`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counting = False
        self.sent = 0
        conn_cls = asyncpg.connection.Connection
        real_execute, real_run = conn_cls.execute, conn_cls._execute
        counter = self

        async def execute(self: Any, query: str, *args: Any, **kw: Any) -> Any:
            if not args and counter.counting:  # with arguments it goes through _execute
                counter.sent += 1
            return await real_execute(self, query, *args, **kw)

        async def run(self: Any, *args: Any, **kw: Any) -> Any:
            if counter.counting:
                counter.sent += 1
            return await real_run(self, *args, **kw)

        monkeypatch.setattr(conn_cls, "execute", execute)
        monkeypatch.setattr(conn_cls, "_execute", run)

    async def over(self, seconds: float) -> int:
        """Statements sent during the next `seconds`."""
        self.sent, self.counting = 0, True
        await asyncio.sleep(seconds)
        self.counting = False
        return self.sent


async def _idle_statements(b: bus.Bus, counter: StatementCounter, topic: str, partitions: int) -> int:
    await b.create_topic(topic, partitions=partitions)
    got: list[Any] = []

    async def handler(m: bus.Message) -> None:
        got.append(m)

    sub = await b.subscribe(f"idle-{topic}", handler, topics=[topic])
    try:
        # Every partition leased and its worker idle; then a probe message proves the group reads.
        async def leased() -> bool:
            owned = await b.pool.fetchval(
                "SELECT count(*) FROM offsets WHERE group_name = $1 AND owner IS NOT NULL", f"idle-{topic}"
            )
            return bool(owned == partitions)

        await eventually(leased)
        await asyncio.sleep(0.5)
        sent = await counter.over(1.5)
        await b.publish(topic, b"probe", key="k")
        await eventually(lambda: len(got) == 1)
        return sent
    finally:
        await sub.stop()


async def test_an_idle_groups_statements_do_not_grow_with_its_partitions(
    connect: Any, fast: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_poll_interval 0.25 s: a fetch and a lease check per partition per interval would be
    # 8 statements a second for each partition (768 in the window at 64 partitions).
    counter = StatementCounter(monkeypatch)
    few = await _idle_statements(await connect(**fast), counter, "few", 2)
    many = await _idle_statements(await connect(**fast), counter, "many", 64)
    assert few > 0
    assert many < few + 62, (few, many)


async def test_an_idle_partition_whose_lease_was_taken_lets_it_go_and_takes_it_again(
    connect: Any, fast: dict[str, float]
) -> None:
    # The poll fallback checks the leases of idle workers in its one statement: a lease reset by
    # hand (an operator's offset reset does this) is noticed, the worker lets go, the member resyncs
    # and a new worker leases the partition again at a newer epoch.
    b = await connect(**fast)
    await b.create_topic("t", partitions=3)
    got: list[bus.Message] = []

    async def handler(m: bus.Message) -> None:
        got.append(m)

    sub = await b.subscribe("g", handler, topics=["t"])

    async def epochs() -> dict[int, tuple[str | None, int]]:
        rows = await b.pool.fetch(
            "SELECT partition_id, owner, lease_epoch FROM offsets WHERE group_name = 'g'"
        )
        return {r[0]: (r[1], r[2]) for r in rows}

    async def all_owned() -> bool:
        now = await epochs()
        return len(now) == 3 and all(owner is not None for owner, _ in now.values())

    await eventually(all_owned)
    before = await epochs()
    pid = min(before)
    await b.pool.execute(
        "UPDATE offsets SET owner = NULL, lease_expires_at = NULL WHERE group_name = 'g' AND partition_id = $1",
        pid,
    )

    async def retaken() -> bool:
        owner, epoch = (await epochs())[pid]
        return owner is not None and epoch > before[pid][1]

    await eventually(retaken)
    await b.publish("t", b"after", partition=(await _partition_name(b, pid)))
    await eventually(lambda: [m.payload for m in got] == [b"after"])
    await sub.stop()


async def _partition_name(b: bus.Bus, pid: int) -> str:
    return str(await b.pool.fetchval("SELECT name FROM partitions WHERE id = $1", pid))


async def test_a_message_whose_notification_was_lost_is_found_by_the_poll_fallback(
    connect: Any, fast: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=4)
    got: list[bus.Message] = []

    async def handler(m: bus.Message) -> None:
        got.append(m)

    checks: list[int] = []
    real = leases.idle_check

    async def recording(conn: Any, entries: list[Any], now: Any = None) -> Any:
        checks.append(len(entries))
        return await real(conn, entries, now)

    monkeypatch.setattr(leases, "idle_check", recording)
    sub = await b.subscribe("g", handler, topics=["t"])
    await eventually(lambda: bool(checks) and checks[-1] == 4)
    # Written behind the bus's back: no NOTIFY reaches the workers, only the poll fallback finds it.
    async with b.pool.acquire() as conn, conn.transaction():
        pid = await conn.fetchval("SELECT id FROM partitions WHERE topic = 't' ORDER BY id LIMIT 1")
        offset = await conn.fetchval(
            "UPDATE partitions SET next_offset = next_offset + 1 WHERE id = $1 RETURNING next_offset - 1", pid
        )
        await conn.execute(
            'INSERT INTO messages (partition_id, "offset", payload) VALUES ($1, $2, $3)',
            pid,
            offset,
            b"quiet",
        )
    await eventually(lambda: [m.payload for m in got] == [b"quiet"])
    await sub.stop()

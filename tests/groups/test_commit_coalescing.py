"""A subscription under steady load writes its cursor rows a few times a second, not once per message.

Each commit writes a new version of the group's cursor row; a snapshot held by
any session keeps every version, and every later read of the row walks them.
The worker coalesces its commits (actors.handler_runner.COMMIT_INTERVAL), and what it
handled is still committed soon after the load stops and when it lets go.
"""

from __future__ import annotations

import asyncio

import bus
from actors import handler_runner
from bus.testing import eventually

# Counts the writes of `committed` with a row per write, in the test's own schema.
COUNT_COMMITS = """
CREATE TABLE commit_writes (at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION note_commit_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO commit_writes DEFAULT VALUES;
    RETURN NULL;
END $$;
CREATE TRIGGER offsets_commit_writes AFTER UPDATE ON offsets FOR EACH ROW
WHEN (NEW.committed IS DISTINCT FROM OLD.committed) EXECUTE FUNCTION note_commit_write();
"""


async def test_steady_load_commits_a_few_times_a_second_and_everything_handled_ends_committed(
    connect, fast
) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    seen: list[int] = []

    async def handler(m: bus.Message) -> None:
        seen.append(m.offset)

    sub = await b.subscribe("g", handler, topics=["t"], start="earliest")
    await b.publish("t", b"first")
    await eventually(lambda: len(seen) == 1)
    await b.pool.execute(COUNT_COMMITS)
    messages, pace = 60, 0.01  # about 100 msg/s for 0.6 s (longer on a busy machine), each handled on its own
    started = asyncio.get_running_loop().time()
    for _ in range(messages):
        await b.publish("t", b"x")
        await asyncio.sleep(pace)
    await eventually(lambda: len(seen) == messages + 1)
    # The last of them is committed by the timer, without a stop or more load.
    await eventually(
        lambda: b.pool.fetchval("SELECT committed = $1 FROM offsets WHERE group_name = 'g'", messages + 1)
    )
    loaded = asyncio.get_running_loop().time() - started
    writes = await b.pool.fetchval("SELECT count(*) FROM commit_writes")
    # At most one write per interval over the time the load and its tail really took (a
    # busy machine stretches the 0.6 s); one per message would be 60.
    bound = loaded / handler_runner.COMMIT_INTERVAL + 3
    assert 1 <= writes <= bound, (writes, bound)
    await sub.stop()


async def test_a_stop_inside_the_interval_commits_what_was_handled(connect, fast, monkeypatch) -> None:
    monkeypatch.setattr(handler_runner, "COMMIT_INTERVAL", 30.0)  # the stop comes long before the timer
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    seen: list[int] = []

    async def handler(m: bus.Message) -> None:
        seen.append(m.offset)

    sub = await b.subscribe("g", handler, topics=["t"], start="earliest")
    await b.publish("t", b"a")
    await eventually(lambda: len(seen) == 1)
    await b.publish("t", b"b")  # handled inside the interval the first commit opened
    await eventually(lambda: len(seen) == 2)
    await asyncio.sleep(0.2)
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'g'") == 1
    await sub.stop()
    committed = await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'g'")
    assert committed == 2

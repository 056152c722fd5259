"""One shape of a batch from the publish call to the statement: `storage.messages.Batch`.

A call's messages are one batch; a flush of several calls is one batch joined from theirs
and written by one `append`. What each message gets must not depend on the calls beside it.
"""

from __future__ import annotations

from datetime import UTC, datetime

import bus
from storage import messages as log_sql


async def _pid(b: bus.Bus, topic: str, partition: str) -> int:
    pid = await b.partition_id(await b.topic(topic), partition, create=False)
    assert pid is not None
    return pid


def _batch(pids: list[int], names: list[str], payloads: list[bytes], *, queue: bool = False) -> log_sql.Batch:
    n = len(pids)
    return log_sql.Batch.of(pids, names, [None] * n, [None] * n, payloads, queue=queue)


async def test_a_batch_joined_from_several_calls_writes_what_each_call_would_alone(b: bus.Bus) -> None:
    await b.create_topic("orders", partitions=2)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    o0, o1, j0 = await _pid(b, "orders", "0"), await _pid(b, "orders", "1"), await _pid(b, "jobs", "0")
    plain = _batch([o0, o1], ["0", "1"], [b"p0", b"p1"])
    keyed = _batch([o0, o1, o1], ["0", "1", "1"], [b"k", b"again", b"free"])
    keyed.ikeys = [("orders", "k", 60.0), ("orders", "k", 60.0), None]  # the second repeats the first
    timed = _batch([j0, j0], ["0", "0"], [b"later", b"now"], queue=True)
    timed.timing = log_sql.Timing([3600.0, None], [None, None], [None, None])
    other_topic = _batch([j0], ["0"], [b"same key, other topic"], queue=True)
    other_topic.ikeys = [("jobs", "k", 60.0)]
    calls = [plain, keyed, timed, other_topic]

    merged = log_sql.Batch.joined(calls)

    assert merged.pids == [o0, o1, o0, o1, o1, j0, j0, j0] and merged.queue
    k = ("orders", "k", 60.0)
    assert merged.ikeys == [None, None, k, k, None, None, None, ("jobs", "k", 60.0)]
    assert merged.timing is not None and merged.timing.delays == [None] * 5 + [3600.0, None, None]
    # The calls keep their own lists: a flush that fails writes them again one by one.
    assert plain.ikeys is None and plain.pids == [o0, o1] and timed.timing.delays == [3600.0, None]

    async with b.pool.acquire() as conn, conn.transaction():
        placed = await log_sql.append(conn, merged, now=datetime.now(UTC))
    assert all(p is not None for p in placed)
    offsets = [(p[0], p[1]) for p in placed if p is not None]
    # Offsets follow batch order within each partition; the repeated key gets its original's place.
    assert offsets == [(o0, 0), (o1, 0), (o0, 1), (o0, 1), (o1, 1), (j0, 0), (j0, 1), (j0, 2)]
    assert placed[3] is not None and placed[3][3] == "0"  # the original's partition name, from the batch
    assert [m.payload for m in await b.read("orders", partition="0")] == [b"p0", b"k"]
    assert [m.payload for m in await b.read("orders", partition="1")] == [b"p1", b"free"]
    assert [m.payload for m in await b.read("jobs", partition="0")] == [
        b"later",
        b"now",
        b"same key, other topic",
    ]
    jobs = await b.pool.fetch(
        "SELECT \"offset\", detached, visible_at > now() + interval '1 hour' - interval '1 minute' AS later "
        'FROM queue_jobs WHERE partition_id = $1 ORDER BY "offset"',
        j0,
    )
    assert [(r["offset"], r["detached"], r["later"]) for r in jobs] == [
        (0, True, True),
        (1, False, False),
        (2, False, False),
    ]

"""How many jobs a queue topic holds, by state (`Admin.queue_depth`, `bus topics`, the dashboard).

A queue topic's log keeps acked jobs until retention removes them, so its size
is not its depth: these statements count the jobs still to be done from the
job states (`queue_job_states`), per partition, and the dead letters that came
from it and still wait in its dead-letter topic.
"""

from __future__ import annotations

from typing import NamedTuple

from storage.db import Conn

# Every partition of the topic, with its waiting (due now, or whose lease ran out: the next take
# gets it), running (leased) and delayed (not due yet) jobs. $1 topic.
QUEUE_DEPTH = """
SELECT p.name AS partition,
       count(j."offset") FILTER (WHERE j.visible_at <= clock_timestamp()) AS waiting,
       count(j."offset") FILTER (WHERE j.visible_at > clock_timestamp() AND j.leased_by IS NOT NULL) AS running,
       count(j."offset") FILTER (WHERE j.visible_at > clock_timestamp() AND j.leased_by IS NULL) AS delayed
FROM partitions p
LEFT JOIN queue_job_states j ON j.partition_id = p.id
WHERE p.topic = $1
GROUP BY p.id, p.name
ORDER BY p.id
"""

# The dead letters from topic $1 still in dead-letter topic $2, by the partition they came from
# (the dead_letter.* headers a queue consumer adds): the jobs not yet taken and acked when $2 is
# a queue, every stored message when it is not.
DEAD_LETTERS_BY_SOURCE = """
SELECT m.headers ->> 'dead_letter.partition' AS partition, count(*) AS dead
FROM topics t
JOIN partitions p ON p.topic = t.name
JOIN messages m ON m.partition_id = p.id AND m."offset" >= p.log_start
WHERE t.name = $2 AND m.headers ->> 'dead_letter.topic' = $1
  AND (t.semantics <> 'queue'
       OR EXISTS (SELECT 1 FROM queue_jobs j WHERE j.partition_id = m.partition_id AND j."offset" = m."offset"))
GROUP BY 1
"""


class PartitionCounts(NamedTuple):
    """One partition's waiting, running and delayed jobs."""

    partition: str
    waiting: int
    running: int
    delayed: int


async def depth(conn: Conn, topic: str) -> list[PartitionCounts]:
    """Every partition of `topic` with its job counts (an empty list: no such partition yet)."""
    rows = await conn.fetch(QUEUE_DEPTH, topic)
    return [PartitionCounts(r["partition"], r["waiting"], r["running"], r["delayed"]) for r in rows]


async def dead_by_source(conn: Conn, topic: str, dead_letter_topic: str) -> dict[str, int]:
    """{source partition: dead letters from `topic` waiting in `dead_letter_topic`}."""
    rows = await conn.fetch(DEAD_LETTERS_BY_SOURCE, topic, dead_letter_topic)
    return {str(r["partition"]): int(r["dead"]) for r in rows}

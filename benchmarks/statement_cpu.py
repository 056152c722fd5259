"""Server CPU of one publishing statement, for comparing releases on the same server.

Wall-clock rates of a publish swing by a factor of two on a shared machine (every commit waits for
the WAL flush, which the disk shares with everything else). The CPU a statement costs its own
backend does not: this runs each of the publishing statements of the release on `PYTHONPATH`
2,000 times in autocommit on one connection (Producer session settings where the release has
them) and reads the backend's user and system time from /proc, so the server must run on this
machine. Rounds alternate between the statements; the median round is printed.

    PYTHONPATH=<tree> python benchmarks/statement_cpu.py DSN [COUNT] [ROUNDS]

Run it with each tree in turn (the release built by `git archive`, and this checkout).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import uuid

import bus
from storage import db, messages


def _backend_cpu(pid: int) -> float:
    """Seconds of CPU the backend `pid` used so far (user + system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(dsn: str, count: int, rounds: int) -> dict[str, float]:
    """Each statement's median CPU per execution (µs), printed and answered."""
    schema = "stmtcpu_" + uuid.uuid4().hex[:8]
    async with bus.connect(dsn, schema=schema, cleaner_interval=0) as b:
        await b.create_topic("t", partitions=12)
        await b.create_topic("q", partitions=1, semantics="queue")
        await b.publish_many("t", [bus.Outgoing(b"x", partition=str(i)) for i in range(12)])
        await b.publish("q", b"x")
        pids = [r[0] for r in await b.pool.fetch("SELECT id FROM partitions WHERE topic = 't' ORDER BY id")]
        queue_pid = await b.pool.fetchval("SELECT id FROM partitions WHERE topic = 'q'")
    # The bus's own connection, with the Producer's session settings where the release has them.
    planned = getattr(messages, "PLANNED_SETTINGS", None)
    conn = await (db.connect(dsn, schema, settings=planned) if planned else db.connect(dsn, schema))
    try:
        eight = pids[:8]
        many = [
            "{" + ",".join(map(str, eight)) + "}",
            None,
            None,
            [b'{"i": 1}'] * 8,
            "{" + ",".join(["0"] * 8) + "}",
            eight,
            [1] * 8,
            None,
        ]
        queued = [f"{{{queue_pid}}}", ["k"], None, [b'{"i": 1}'], "{0}", [queue_pid], [1], None]
        cases: dict[str, tuple[str, list[object]]] = {
            "lone publish, head function": (messages.APPEND_SINGLE, [pids[0], "k", None, b'{"i": 1}', None]),
            "8-partition flush, head function": (messages.APPEND, many),
            "lone queue publish, head function": (messages.APPEND_QUEUE, queued),
        }
        if hasattr(messages, "APPEND_SINGLE_PLANNED"):
            cases["lone publish, planned"] = (
                messages.APPEND_SINGLE_PLANNED,
                cases["lone publish, head function"][1],
            )
        if hasattr(messages, "APPEND_PLANNED"):
            cases["8-partition flush, planned"] = (messages.APPEND_PLANNED, many)
        if hasattr(messages, "APPEND_QUEUE_PLANNED"):
            cases["lone queue publish, planned"] = (messages.APPEND_QUEUE_PLANNED, queued)
        prepared = {name: (await conn.prepare(sql), args) for name, (sql, args) in cases.items()}
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        spent: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, (statement, args) in prepared.items():
                before = _backend_cpu(backend)
                for _ in range(count):
                    await statement.fetch(*args)
                spent[name].append((_backend_cpu(backend) - before) / count * 1e6)
        medians = {name: statistics.median(values) for name, values in spent.items()}
        for name, value in medians.items():
            print(f"{name}: {value:.0f} µs per statement (median of {rounds} rounds)")
        return medians
    finally:
        await db.drop_schema(conn, schema)
        await conn.close()


if __name__ == "__main__":
    arguments = sys.argv[1:]
    asyncio.run(
        main(
            arguments[0],
            int(arguments[1]) if len(arguments) > 1 else 2000,
            int(arguments[2]) if len(arguments) > 2 else 6,
        )
    )

"""One group-benchmark member process (driven by `benchmarks/groups.py`).

    python -m benchmarks.groups_member MODE DSN SCHEMA GROUP TOPIC [options]

Every mode prints ``ready`` once connected (imports and pool setup are not
timed), waits for a ``go`` line on stdin, starts consuming, prints
``joined`` (``poll`` and ``raw`` also ``first`` when the first messages
arrive), and stops cleanly on SIGTERM, on a ``stop`` line or when stdin
closes. Modes:

* ``poll``: one bus Consumer, ``max_poll_records=--batch``, auto-commit (so
  every poll commits the previous batch), counting messages;
* ``subscribe``: ``--members`` bus Subscriptions on one Bus whose handler
  counts; with ``--out`` it also appends ``partition offset pid time`` per
  delivery, the wall time (`time.time()`) the handler saw it (line-buffered,
  so a SIGKILL loses nothing already written);
* ``raw``: the hand-written baseline, no bus code on the hot path. It owns the
  fixed partitions given by ``--partitions`` (ids) and, per partition, loops:
  in one transaction read the next ``--batch`` rows by offset from `messages`
  and UPDATE the group's `offsets` row. One task per partition over a plain
  asyncpg pool, the same concurrency the bus's PartitionWorkers have.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

import asyncpg

import bus
from storage.names import validate_schema

# The raw baseline's statements: what a careful engineer writes by hand against
# the same tables the bus uses (the same columns fetched, the same cursor row updated).
RAW_POSITIONS = """
SELECT partition_id, committed FROM offsets WHERE group_name = $1 AND partition_id = ANY($2::bigint[])
"""

RAW_FETCH = """
SELECT "offset", key, headers::text AS headers, payload, created_at
FROM messages
WHERE partition_id = $1 AND "offset" >= $2
ORDER BY "offset"
LIMIT $3
"""

RAW_COMMIT = """
UPDATE offsets SET committed = $3, committed_at = clock_timestamp()
WHERE group_name = $1 AND partition_id = $2
"""

RAW_IDLE_SLEEP = 0.05  # a drained raw partition looks again this often


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.groups_member", description=__doc__)
    p.add_argument("mode", choices=("poll", "subscribe", "raw"))
    p.add_argument("dsn")
    p.add_argument("schema")
    p.add_argument("group")
    p.add_argument("topic")
    p.add_argument("--config", default="{}", help="JSON object of bus.connect() keyword arguments")
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--members", type=int, default=1)
    p.add_argument("--assignor", default="range", help="subscribe mode: the group's assignor")
    p.add_argument("--partitions", default="", help="raw mode: comma-separated partition ids")
    p.add_argument(
        "--out", default=None, help="subscribe mode: append 'partition offset pid time' per delivery"
    )
    args = p.parse_args(argv)
    if args.dsn == "-":  # the DSN (with its password) from the environment, not the command line
        args.dsn = os.environ["BUS_DSN"]
    return args


async def _wait_for_line(reader: asyncio.StreamReader, wanted: str) -> bool:
    """True when `wanted` arrives on stdin; False when stdin closes first."""
    while True:
        line = await reader.readline()
        if not line:
            return False
        if line.decode().strip() == wanted:
            return True


async def _stdin() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def _open_log(path: str) -> TextIO:
    """Line-buffered append: a SIGKILL loses nothing already written."""
    return open(path, "a", buffering=1)  # noqa: SIM115 (closed by the caller)


def _say(word: str) -> None:
    sys.stdout.write(word + "\n")
    sys.stdout.flush()


async def _stopper(reader: asyncio.StreamReader) -> asyncio.Event:
    """An event set by SIGTERM, a `stop` line or stdin closing."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def watch() -> None:
        await _wait_for_line(reader, "stop")
        stop.set()

    asyncio.get_running_loop().create_task(watch())
    return stop


async def run_bus(args: argparse.Namespace, reader: asyncio.StreamReader) -> None:
    """`poll` and `subscribe` modes."""
    config: dict[str, Any] = {"schema": args.schema, **json.loads(args.config)}
    out = _open_log(args.out) if args.out else None
    pid = os.getpid()
    count = 0

    async def handler(m: bus.Message) -> None:
        nonlocal count
        count += 1
        if out is not None:
            out.write(f"{m.partition} {m.offset} {pid} {time.time():.4f}\n")

    async with bus.connect(args.dsn, **config) as b:
        await b.topic(args.topic)  # warm the topic cache before the clock starts
        _say("ready")
        if not await _wait_for_line(reader, "go"):
            return
        stop = await _stopper(reader)
        if args.mode == "poll":
            async with b.consumer(args.group, topics=[args.topic], max_poll_records=args.batch) as c:
                _say("joined")
                while not stop.is_set():
                    got = len(await c.poll(timeout=0.1))
                    if got and not count:
                        _say("first")
                    count += got
        else:
            subs = [
                await b.subscribe(
                    args.group, handler, topics=[args.topic], batch_size=args.batch, assignor=args.assignor
                )
                for _ in range(args.members)
            ]
            _say("joined")
            await stop.wait()
            for s in subs:
                await s.stop()
    if out is not None:
        out.close()
    _say(f"count {count}")


async def run_raw(args: argparse.Namespace, reader: asyncio.StreamReader) -> None:
    """`raw` mode: fixed partitions, read-a-batch-and-update-the-cursor per transaction."""
    pids = [int(p) for p in args.partitions.split(",") if p]
    pool = await asyncpg.create_pool(
        args.dsn,
        min_size=max(1, len(pids)),
        max_size=max(1, len(pids)),
        server_settings={
            "search_path": validate_schema(args.schema),
            "application_name": "bench-raw-consumer",
        },
    )
    assert pool is not None
    count = 0
    try:
        _say("ready")
        if not await _wait_for_line(reader, "go"):
            return
        stop = await _stopper(reader)
        positions = {int(r[0]): int(r[1]) for r in await pool.fetch(RAW_POSITIONS, args.group, pids)}
        _say("joined")

        async def work(pid: int) -> None:
            nonlocal count
            position = positions[pid]
            while not stop.is_set():
                async with pool.acquire() as conn, conn.transaction():
                    rows = await conn.fetch(RAW_FETCH, pid, position, args.batch)
                    if rows:
                        position = rows[-1]["offset"] + 1
                        await conn.execute(RAW_COMMIT, args.group, pid, position)
                if rows and not count:
                    _say("first")
                count += len(rows)
                if not rows:
                    await asyncio.sleep(RAW_IDLE_SLEEP)

        await asyncio.gather(*(work(p) for p in pids))
    finally:
        await pool.close()
    _say(f"count {count}")


async def main(argv: list[str]) -> None:
    """Parse the arguments and run the mode."""
    args = _parse(argv)
    reader = await _stdin()
    if args.mode == "raw":
        await run_raw(args, reader)
    else:
        await run_bus(args, reader)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))

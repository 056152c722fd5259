"""One process of a service during a rolling deploy: a group member, a queue consumer, an
event-store claimer and an event appender, on whichever release is first on the path.

    python -m tests.versions.rolling_worker DSN SCHEMA OUTFILE

Uses only the public API both releases have. Appends one line per handled message to
OUTFILE, flushed per line: `g PARTITION OFFSET` (group delivery), `q PARTITION OFFSET`
(queue job acked), `e POSITION` (event handled and acked), `a POSITION ID` (append
returned). Appends stop once OUTFILE.quiet exists. Prints `ready RELEASE-FILE` once connected; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import uuid

import bus
from bus.testing import FAST


class Enrolled(bus.Event, tag="rolling.enrolled"):
    course: str
    id: str


async def main() -> None:
    dsn, schema, out = sys.argv[1:4]
    # Warnings (a fenced member among them) go to stderr, which the test reads after the run.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    fh = open(out, "a", buffering=1)  # noqa: ASYNC230, SIM115 - once at start; closed at the end
    worker = f"w-{os.getpid()}"

    async def on_order(m: bus.Message) -> None:
        fh.write(f"g {m.partition} {m.offset}\n")

    async with bus.connect(dsn, schema=schema, **FAST) as b:
        await b.create_topic("orders", partitions=4)
        await b.create_topic("jobs", partitions=4, semantics="queue")
        store = b.event_store("courses")

        async def jobs() -> None:
            async with b.queue_consumer("jobs", visibility_timeout=5.0) as q:
                while not stop.is_set():
                    for job in await q.take(max_messages=10, timeout=0.2):
                        await q.ack(job)
                        fh.write(f"q {job.partition} {job.offset}\n")

        async def claims() -> None:
            while not stop.is_set():
                c = await store.claim_next(
                    "projection", partition_by=["course"], handled_types=[Enrolled], worker_id=worker
                )
                if c is None:
                    await asyncio.sleep(0.05)
                    continue
                await store.ack("projection", offset_id=c.offset_id, position=c.messages[-1].position)
                for e in c.messages:
                    fh.write(f"e {e.position}\n")

        async def appends() -> None:
            n = 0
            while not stop.is_set() and not os.path.exists(out + ".quiet"):  # noqa: ASYNC240 - a stat
                ident = uuid.uuid4().hex
                (rec,) = await store.append([Enrolled(course=f"c{n % 5}", id=ident)])
                fh.write(f"a {rec.position} {ident}\n")
                n += 1
                await asyncio.sleep(0.05)

        await store.register_group("projection")
        sub = await b.subscribe("orders", on_order, topics=["orders"])
        tasks = [asyncio.create_task(f()) for f in (jobs, claims, appends)]
        print("ready", bus.__file__, flush=True)
        await stop.wait()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await sub.stop()
    fh.close()


if __name__ == "__main__":
    asyncio.run(main())

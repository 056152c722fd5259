"""A process of the job feature tests.

python -m tests.queues.job_process unique SCHEMA TOPIC KEY N OUTFILE
    publishes N times at once with unique=bus.Unique(KEY), writes each Record's offset
python -m tests.queues.job_process work SCHEMA TOPIC MARKER
    runs b.worker(TOPIC) with a 1 s visibility timeout (each job 50 ms of work), writes
    MARKER once it acked a job, until killed
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import bus


async def unique(schema: str, topic: str, key: str, n: str, out: str) -> None:
    async with bus.connect(os.environ["BUS_DSN"], schema=schema) as b:
        recs = await asyncio.gather(
            *(b.publish(topic, {"i": i}, unique=bus.Unique(key)) for i in range(int(n)))
        )
        Path(out).write_text("\n".join(f"{r.partition} {r.offset}" for r in recs), encoding="utf-8")  # noqa: ASYNC240 - the test's marker, written by a process of its own


async def work(schema: str, topic: str, marker: str) -> None:
    async def handle(job: bus.Message) -> None:
        await asyncio.sleep(0.05)

    async with bus.connect(os.environ["BUS_DSN"], schema=schema) as b:
        w = await b.worker(topic, handle, concurrency=4, visibility_timeout=1)
        while True:
            await asyncio.sleep(0.02)
            if w.handled:
                Path(marker).write_text(str(w.handled), encoding="utf-8")  # noqa: ASYNC240 - the test's marker, written by a process of its own


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    asyncio.run(unique(*args) if what == "unique" else work(*args))

"""One consumer process of the cross-process queue limit tests.

    python -m tests.queues.limits_worker DSN SCHEMA TOPIC OUTFILE WORK_SECONDS IDLE_SECONDS

Takes jobs until none came for IDLE_SECONDS, holding each for WORK_SECONDS.
Writes per job, flushed per line: `T key time before` when its take returned
(`before`: when that take was called; the database took it in between) and
`A key time` just before its ack (so [T, A] is inside the interval the
database counts it in flight), and `R` once it is ready to take. Takes do not
wait (timeout 0: a take's interval is one statement's), an empty one sleeps 20 ms.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import bus


async def main(dsn: str, schema: str, topic: str, path: str, work: float, idle: float) -> None:
    async with bus.connect(dsn, schema=schema) as b, b.queue_consumer(topic) as q:
        with await asyncio.to_thread(open, path, "a", encoding="utf-8") as out:
            out.write("R\n")
            out.flush()
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < idle:
                before = time.time()
                jobs = await q.take(max_messages=3, timeout=0)
                now = time.time()
                if not jobs:
                    await asyncio.sleep(0.02)
                    continue
                quiet_since = time.monotonic()
                for job in jobs:
                    out.write(f"T {job.key} {now} {before}\n")
                out.flush()

                async def finish(job: bus.Message) -> None:
                    await asyncio.sleep(work)
                    out.write(f"A {job.key} {time.time()}\n")
                    out.flush()
                    await q.ack(job)

                await asyncio.gather(*(finish(j) for j in jobs))


if __name__ == "__main__":
    dsn, schema, topic, path, work, idle = sys.argv[1:7]
    dsn = os.environ["BUS_DSN"] if dsn == "-" else dsn
    asyncio.run(main(dsn, schema, topic, path, float(work), float(idle)))

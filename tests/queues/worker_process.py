"""A worker process whose handler never returns (killed by the test that starts it).

    python -m tests.queues.worker_process SCHEMA TOPIC MARKER

Runs `b.worker(TOPIC, ...)` with a 30 s visibility timeout; its handler writes
MARKER with the job's offset, then waits forever.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import bus


async def main(schema: str, topic: str, marker: str) -> None:
    async def hang(job: bus.Message) -> None:
        Path(marker).write_text(str(job.offset), encoding="utf-8")  # noqa: ASYNC240 - the test's marker, written by a process of its own
        await asyncio.Event().wait()

    async with bus.connect(os.environ["BUS_DSN"], schema=schema) as b:
        w = await b.worker(topic, hang, concurrency=4, visibility_timeout=30)
        await asyncio.Event().wait()
        await w.stop()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))

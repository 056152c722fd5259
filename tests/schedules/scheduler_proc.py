"""A service process that declares a schedule at start and runs its Bus until SIGTERM or SIGKILL.

    python -m tests.schedules.scheduler_proc DSN SCHEMA TOPIC CRON

Prints "ready" once its schedule is declared.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import bus


async def main() -> None:
    dsn, schema, topic, cron = sys.argv[1:5]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with bus.connect(dsn, schema=schema, scheduler_interval=0.1, cleaner_interval=0) as b:
        await b.schedule("every", cron=cron, topic=topic, payload={"from": "proc"})
        print("ready", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())

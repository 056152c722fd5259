"""A group member in its own OS process, for failover tests.

    python -m tests.groups.member_proc DSN SCHEMA GROUP TOPIC OUTFILE [key=value config...]

Subscribes with a handler that appends "partition offset pid" per delivery to
OUTFILE (flushed per line, so a SIGKILL loses nothing already written) and
prints "ready" once it owns at least one partition.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import bus


async def main() -> None:
    dsn, schema, group, topic, out = sys.argv[1:6]
    dsn = os.environ["BUS_DSN"] if dsn == "-" else dsn
    config: dict[str, float | str] = {"schema": schema}
    for kv in sys.argv[6:]:
        k, v = kv.split("=", 1)
        config[k] = float(v) if k != "default_start" else v
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    fh = await asyncio.to_thread(open, out, "a", buffering=1)
    pid = os.getpid()

    async def handler(m: bus.Message) -> None:
        fh.write(f"{m.partition} {m.offset} {pid}\n")

    async with bus.connect(dsn, **config) as b:
        sub = await b.subscribe(group, handler, topics=[topic])
        print("joined", flush=True)
        await stop.wait()
        await sub.stop()
    fh.close()


if __name__ == "__main__":
    asyncio.run(main())

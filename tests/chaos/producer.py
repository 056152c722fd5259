"""The chaos producer in its own OS process.

    python -m tests.chaos.producer DSN SCHEMA TOPIC PARTITIONS OUTFILE RATE [PREFIX]

Publishes {"id": "<prefix>-<n>"} to partition n % PARTITIONS at about RATE
messages per second (TOPIC "es:STORE": appends `Item(account="a<n % PARTITIONS>",
id="<prefix>-<n>")` to the event store STORE instead, recorded with the
store as topic, the account as partition and the position as offset) and appends "A topic partition offset id time" to OUTFILE
only after `publish` returned (flushed per line). TOPIC "lq:QUEUE" publishes
to the limited queue QUEUE with a key, some jobs delayed and some prioritized
(see `limited_job`); a delayed one is also recorded as "W id not_before": the
publish's start plus its delay, before which its job must not be handed out.
A publish that fails (the
database restarted, the connection was terminated) is recorded as
"F id time error" and not retried under the same id: it may or may not exist,
and the checker only holds the bus to what was acknowledged. SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import bus
from tests.chaos.member import Item, limited_job, plain_tracebacks


async def main() -> None:
    dsn, schema, topic, parts, out, rate = sys.argv[1:7]
    dsn = os.environ["BUS_DSN"] if dsn == "-" else dsn  # "-": from the environment (no password in argv)
    prefix = sys.argv[7] if len(sys.argv) > 7 else "p"
    partitions, interval = int(parts), 1.0 / float(rate)
    plain_tracebacks()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    with open(out, "a", buffering=1) as fh:  # noqa: ASYNC230 (once, at start-up)
        while True:
            try:
                b = await bus.connect(dsn, schema=schema)
                break
            except bus.errors.StorageUnavailableError:
                await asyncio.sleep(0.5)  # the database is restarting: retry, as documented
        async with b:
            store = b.event_store(topic[3:]) if topic.startswith("es:") else None
            print("ready", flush=True)
            n = 0
            next_at = time.monotonic()
            while not stop.is_set():
                msg_id = f"{prefix}-{n}"
                started = time.time()
                delay = None
                try:
                    if topic.startswith("lq:"):
                        key, delay, priority = limited_job(n)
                        rec = await b.publish(
                            topic[3:], {"id": msg_id}, key=key, delay=delay, priority=priority
                        )
                    elif store is not None:
                        [pe] = await store.append(Item(account=f"a{n % partitions}", id=msg_id))
                        rec = bus.Record(store.name, f"a{n % partitions}", pe.position, pe.created_at)
                    else:
                        rec = await b.publish(topic, {"id": msg_id}, partition=str(n % partitions))
                except Exception as exc:  # anything: recorded, the run goes on
                    text = repr(exc).replace("\t", " ").replace("\n", " ")[:300]
                    fh.write(f"F\t{msg_id}\t{time.time():.6f}\t{text}\n")
                    await asyncio.sleep(0.1)
                else:
                    if delay:
                        fh.write(f"W\t{msg_id}\t{started + delay:.6f}\n")
                    fh.write(f"A\t{rec.topic}\t{rec.partition}\t{rec.offset}\t{msg_id}\t{time.time():.6f}\n")
                n += 1
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    next_at = time.monotonic()
    print("stopped", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

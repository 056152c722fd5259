"""Outage: publish → a waiting `take`, before and after the database was away.

Starts an embedded server of its own, opens a Bus with a queue consumer,
measures the latency from `publish` to the return of a `take` that was
already waiting (median of N), stops the server for `--down` seconds
(`pg_ctl stop -m fast`, then start on the same port) with the Bus open,
and measures again: with the consumer that stayed open, and with a new
queue consumer opened after the outage. The ratio after/before says whether
the wake-ups came back (a lost wake-up waits for the poll: `max_poll_interval`).

    python -m benchmarks.outage --down 10 --samples 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import bus
from bus.errors import BusError
from bus.server.embedded import ensure_server, restart_server, stop_server

TOPIC = "outage-jobs"


async def _wake_latency(b: bus.Bus, q: bus.QueueConsumer, samples: int) -> list[float]:
    """Seconds from `publish` to the return of a take that waited for it, `samples` times."""
    out = []
    for i in range(samples):
        take = asyncio.ensure_future(q.take(1, timeout=10.0))
        await asyncio.sleep(0.1)  # the take is waiting
        t0 = time.perf_counter()
        await b.publish(TOPIC, {"i": i})
        got = await take
        out.append(time.perf_counter() - t0)
        for m in got:
            await q.ack(m)
    return out


async def _until_available(b: bus.Bus) -> float:
    t0 = time.monotonic()
    while True:
        try:
            await b.list_topics()
            return time.monotonic() - t0
        except BusError:
            await asyncio.sleep(0.1)


async def run(down: float, samples: int) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="bus-outage-bench-"))
    await asyncio.to_thread(home.chmod, 0o755)  # the server runs as another user under root
    server = await asyncio.to_thread(ensure_server, home)
    new: list[float] = []
    new_error = ""
    try:
        async with bus.connect(server.dsn) as b:
            await b.create_topic(TOPIC, partitions=4, semantics="queue")
            async with b.queue_consumer(TOPIC) as q:
                before = await _wake_latency(b, q, samples)
                await asyncio.to_thread(restart_server, home, down=down)
                back = await _until_available(b)
                await asyncio.sleep(1.0)
                after = await _wake_latency(b, q, samples)
            try:
                async with b.queue_consumer(TOPIC) as q2:
                    new = await _wake_latency(b, q2, samples)
            except Exception as exc:  # what a release that does not ride out outages raises here
                new_error = f"{type(exc).__name__}: {exc}"
            health = b.health().status if hasattr(b, "health") else "(no Bus.health)"
    finally:
        await asyncio.to_thread(stop_server, home)
    result = {
        "before_ms": statistics.median(before) * 1000,
        "after_ms": statistics.median(after) * 1000,
        "new_consumer_ms": statistics.median(new) * 1000 if new else float("nan"),
        "available_after_s": back,
    }
    ratio = result["after_ms"] / result["before_ms"]
    print(f"outage of {down:.0f} s, {samples} samples each, median publish -> waiting take:")
    print(f"  before the outage            {result['before_ms']:8.1f} ms")
    print(f"  after, the open consumer     {result['after_ms']:8.1f} ms  ({ratio:.2f}x)")
    if new_error:
        print(f"  after, a new queue consumer  fails: {new_error[:160]}")
    else:
        ratio = result["new_consumer_ms"] / result["before_ms"]
        print(f"  after, a new queue consumer  {result['new_consumer_ms']:8.1f} ms  ({ratio:.2f}x)")
    print(f"  first statement {back:.2f} s after the server was back; health after: {health}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--down", type=float, default=10.0, help="seconds the server stays stopped")
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(run(args.down, args.samples))


if __name__ == "__main__":
    main()

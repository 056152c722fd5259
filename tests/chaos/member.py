"""A chaos group member in its own OS process.

    python -m tests.chaos.member DSN SCHEMA GROUP TOPIC OUTFILE MODE SLOW [key=value config...]

(config: the Bus's float settings, plus `assignor=` and `slow_seconds=`.)

MODE "handler": `b.subscribe` (the actors commit per batch); MODE "poll":
poll + an explicit `commit()` after each batch is recorded. Every delivery is
appended to OUTFILE as a tab-separated line, flushed per line (a SIGKILL loses
nothing already written):

    D group topic partition offset msg_id pid member generation time

SLOW "1": SIGUSR1 makes the next handled message block the whole process
(time.sleep, heartbeats included) for `slow_seconds`, longer than the lease,
recorded as "S start|end time" lines. Connection loss is the bus's to survive;
errors the member sees are recorded as "E time kind message" lines. SIGTERM
stops the member gracefully (commit, release, leave).

The library's own events that make a process read some messages again (its
member fenced and re-joined, a worker's lease lost, an actor restarted by its
supervisor, a release or leave that failed) are recorded as
"V time event detail" lines, so the checker can tell such a re-read from a
duplicate nothing explains.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any, TextIO

import msgspec
import structlog

import bus

# The library events a chaos member records (see the module docstring).
RECORDED_EVENTS = frozenset({
    "member_fenced", "member_joined", "member_expired", "lease_lost", "actor.failed", "actor.restarting",
    "release_failed", "leave_failed", "partition_acquired", "supervisor.escalating",
})


class Recorder:
    """Appends delivery and event lines for one process."""

    def __init__(self, fh: TextIO, group: str, slow_seconds: float) -> None:
        self.fh = fh
        self.group = group
        self.pid = os.getpid()
        self.slow_seconds = slow_seconds
        self.slow_next = False

    def delivery(self, m: bus.Message, member: str | None, generation: int) -> None:
        msg_id = msgspec.json.decode(m.payload)["id"]
        self.fh.write(
            f"D\t{self.group}\t{m.topic}\t{m.partition}\t{m.offset}\t{msg_id}\t{self.pid}\t{member}\t"
            f"{generation}\t{time.time():.6f}\n"
        )

    def maybe_stall(self) -> None:
        if not self.slow_next:
            return
        self.slow_next = False
        self.fh.write(f"S\tstart\t{time.time():.6f}\n")
        # Blocking on purpose: the heartbeat stalls too, so the lease expires under the handler.
        time.sleep(self.slow_seconds)
        self.fh.write(f"S\tend\t{time.time():.6f}\n")

    def event(self, _logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        """A structlog processor: record the events in RECORDED_EVENTS, pass everything on."""
        name = event_dict.get("event")
        if name in RECORDED_EVENTS:
            detail = " ".join(
                f"{k}={v}" for k, v in event_dict.items() if k not in ("event", "exc_info", "timestamp", "level")
            )
            detail = detail.replace("\t", " ").replace("\n", " ")[:300]
            self.fh.write(f"V\t{time.time():.6f}\t{name}\t{detail}\n")
        return event_dict

    def error(self, kind: str, exc: BaseException) -> None:
        text = repr(exc).replace("\t", " ").replace("\n", " ")[:300]
        self.fh.write(f"E\t{time.time():.6f}\t{kind}\t{text}\n")


async def run_handler(b: bus.Bus, rec: Recorder, topic: str, assignor: str, stop: asyncio.Event) -> None:
    sub: Any = None

    async def handler(m: bus.Message) -> None:
        rec.maybe_stall()
        rec.delivery(m, sub.member_id if sub else None, sub.generation if sub else -1)

    sub = await b.subscribe(rec.group, handler, topics=[topic], start="earliest", batch_size=50,
                            assignor=assignor)
    print("joined", flush=True)
    await stop.wait()
    await sub.stop()


async def run_poll(b: bus.Bus, rec: Recorder, topic: str, assignor: str, stop: asyncio.Event) -> None:
    c: Any = None

    async def commit_before_revoke(partitions: set[bus.TopicPartition]) -> None:
        # Kafka's pattern: commit what was handled while the leases are still ours, so a
        # clean handover re-delivers nothing.
        try:
            await c.commit()
        except bus.errors.BusError as exc:
            rec.error("revoke_commit", exc)

    c = b.consumer(rec.group, topics=[topic], start="earliest", auto_commit=False, max_poll_records=50,
                   assignor=assignor, on_revoke=commit_before_revoke)
    async with c:
        print("joined", flush=True)
        while not stop.is_set():
            try:
                batch = await c.poll(timeout=0.3)
            except bus.errors.BusError as exc:
                rec.error("poll", exc)
                await asyncio.sleep(0.2)
                continue
            for m in batch:
                rec.maybe_stall()
                rec.delivery(m, c.member_id, c.generation)
            if batch:
                try:
                    await c.commit()
                except bus.errors.BusError as exc:
                    # Stale: the partition moved on, its new owner re-reads. Unavailable: same, later.
                    rec.error("commit", exc)


async def watch_loop_lag(rec: Recorder, every: float = 0.1, report: float = 0.5) -> None:
    """Record "V time loop_lag seconds=N" when this process's event loop ran late by more than `report`.

    A late loop (CPU starved, blocked) delays heartbeats like a pause does: it tells
    a fence that followed from a bus actor that was stuck on its own.
    """
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(every)
        late = loop.time() - t0 - every
        if late > report:
            rec.fh.write(f"V\t{time.time():.6f}\tloop_lag\tseconds={late:.3f}\n")


async def main() -> None:
    dsn, schema, group, topic, out, mode, slow = sys.argv[1:8]
    config: dict[str, Any] = {"schema": schema}
    slow_seconds = 0.0
    assignor = "range"
    for kv in sys.argv[8:]:
        k, v = kv.split("=", 1)
        if k == "slow_seconds":
            slow_seconds = float(v)
        elif k == "assignor":
            assignor = v
        else:
            config[k] = float(v)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    with open(out, "a", buffering=1) as fh:  # noqa: ASYNC230 (once, at start-up)
        rec = Recorder(fh, group, slow_seconds)
        # Every library event passes through rec.event first. Tracebacks print plain: the
        # default (rich, with locals) blocks the event loop for seconds per traceback on
        # loaded cores, which fenced every member after each database restart.
        processors = [
            structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
            if isinstance(p, structlog.dev.ConsoleRenderer) else p
            for p in structlog.get_config()["processors"]
        ]
        structlog.configure(processors=[rec.event, *processors])
        if slow == "1":
            loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(rec, "slow_next", True))
        watchdog = asyncio.create_task(watch_loop_lag(rec))
        # Joining may meet the database down (a restart): the documented answer is to retry.
        while not stop.is_set():
            try:
                async with bus.connect(dsn, **config) as b:
                    if mode == "poll":
                        await run_poll(b, rec, topic, assignor, stop)
                    else:
                        await run_handler(b, rec, topic, assignor, stop)
            except bus.errors.StorageUnavailableError as exc:
                rec.error("start", exc)
                await asyncio.sleep(0.5)
        watchdog.cancel()
    print("stopped", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
